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


# The gateway's layers, outermost first: route handlers (HTTP in, one call to a service out),
# the serving layer (a parsed request -> an engine submission -> an answer, for every API that
# runs inference), the engine's face. Routes reach the engine only through serving; serving
# and the batch runner know no route module.
ROUTE_MODULES = ("gateway/openai_api.py", "gateway/batch_api.py", "gateway/tokenize_api.py",
                 "gateway/usage_api.py", "gateway/metrics_api.py", "gateway/responses_api.py",
                 "gateway/messages_api.py")
INFERENCE_ROUTES = ("gateway/openai_api.py", "gateway/batch_api.py", "gateway/tokenize_api.py",
                    "gateway/responses_api.py", "gateway/messages_api.py")
ROUTE_NAMES = {"lockgate." + m.removesuffix(".py").replace("/", ".") for m in ROUTE_MODULES} | {
    "lockgate.gateway.admin", "lockgate.gateway.app", "lockgate.gateway.cli", "lockgate.gateway.server"}


def _is_route(module: str) -> bool:
    return any(module == r or module.startswith(r + ".") for r in ROUTE_NAMES)


def test_inference_routes_reach_the_engine_only_through_serving():
    bad = [f"{where}:{line} imports {mod}" for where, line, mod in gateway_imports()
           if where in INFERENCE_ROUTES and (mod == "lockgate.engine" or mod.startswith("lockgate.engine."))]
    assert not bad, "a route imports the engine instead of calling the serving layer:\n" + "\n".join(bad)
    serving_users = {where for where, _, mod in gateway_imports() if mod.startswith("lockgate.gateway.serving")}
    assert {"gateway/openai_api.py", "gateway/tokenize_api.py", "gateway/responses_api.py",
            "gateway/messages_api.py"} <= serving_users   # batch_api only stores rows


def test_serving_and_the_batch_runner_import_no_route():
    inner = ("gateway/serving/", "gateway/batch_runner.py", "gateway/batch_line.py")
    bad = [f"{where}:{line} imports {mod}" for where, line, mod in gateway_imports()
           if where.startswith(inner) and _is_route(mod)]
    assert not bad, "the serving layer reaches back into the routes:\n" + "\n".join(bad)


def test_the_layer_checks_see_a_violation(tmp_path, monkeypatch):
    """The two checks above, on a gateway tree that breaks each rule once."""
    (tmp_path / "gateway" / "serving").mkdir(parents=True)
    (tmp_path / "gateway" / "openai_api.py").write_text("from lockgate.engine import SamplingParams\n")
    (tmp_path / "gateway" / "tokenize_api.py").write_text("from lockgate.gateway.serving import prepare\n")
    (tmp_path / "gateway" / "serving" / "run.py").write_text("from lockgate.gateway.openai_api import router\n")
    monkeypatch.setattr(__import__(__name__, fromlist=["GATEWAY"]), "GATEWAY", tmp_path / "gateway")
    with pytest.raises(AssertionError, match="imports the engine"):
        test_inference_routes_reach_the_engine_only_through_serving()
    with pytest.raises(AssertionError, match="reaches back"):
        test_serving_and_the_batch_runner_import_no_route()
