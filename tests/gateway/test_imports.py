"""The gateway imports only the engine's public face (`lockgate.engine`, whose `__init__` says what it
holds) and nothing of the benchmarks. Every module of gateway/ is read with `ast`, imports
inside functions included, so a lazy import cannot slip past."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) of every import in the file, at any depth; `from x import y` gives x
    and also x.y (y may be a submodule)."""
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
            out.extend((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)
    return out


def gateway_imports() -> list[tuple[str, int, str]]:
    modules = sorted(GATEWAY.rglob("*.py"))
    assert modules, f"no modules under {GATEWAY}"
    return [(str(p.relative_to(GATEWAY.parent)), line, mod)
            for p in modules for line, mod in imported_modules(p)]


def _is_engine_inside(module: str, public: set[str]) -> bool:
    """`lockgate.engine.X` where X is a submodule, not a name `engine` exports."""
    parts = module.split(".")
    return parts[:2] == ["lockgate", "engine"] and len(parts) > 2 and parts[2] not in public


def test_gateway_imports_only_the_engine_face():
    from lockgate import engine

    public = set(engine.__all__)
    bad = [f"{where}:{line} imports {mod}" for where, line, mod in gateway_imports()
           if _is_engine_inside(mod, public)]
    assert not bad, "gateway reaches inside the engine:\n" + "\n".join(bad)


def test_gateway_imports_no_benchmarks():
    bad = [f"{where}:{line} imports {mod}" for where, line, mod in gateway_imports()
           if mod == "lockgate.loadtests" or mod.startswith("lockgate.loadtests.")]
    assert not bad, "gateway imports the benchmarks:\n" + "\n".join(bad)


@pytest.mark.parametrize("source, expected", [
    ("import lockgate.engine.lora", True),
    ("from lockgate.engine.async_engine import RequestStream", True),
    ("def f():\n    from lockgate.engine.demo_model import write_demo_model\n", True),
    ("from lockgate.engine import AsyncEngine, RequestStream", False),
    ("import lockgate.engine", False),
    ("from lockgate import engine", False),
])
def test_the_walk_sees_every_kind_of_import(tmp_path, source, expected):
    """The check itself, on small sources: nested and `from` imports are found."""
    from lockgate import engine

    f = tmp_path / "m.py"
    f.write_text(source)
    found = any(_is_engine_inside(mod, set(engine.__all__)) for _, mod in imported_modules(f))
    assert found is expected
