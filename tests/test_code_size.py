"""Code stays small enough to read: a module of engine/, gateway/ or tenancy/ fits in 450
lines and a function there in 60; a benchmark's function (loadtests/) in 80, since a
benchmark reads as one story of set-up, run and report. A function is measured from its
`def` line to its last line (decorators excluded), nested functions on their own as well."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

MODULE_LIMIT = 450
FUNCTION_LIMIT = 60
BENCH_FUNCTION_LIMIT = 80

# folder: (the most lines a module may have, or None for no limit; the most a function may)
LIMITS: dict[str, tuple[int | None, int]] = {
    "engine": (MODULE_LIMIT, FUNCTION_LIMIT),
    "gateway": (MODULE_LIMIT, FUNCTION_LIMIT),
    "tenancy": (MODULE_LIMIT, FUNCTION_LIMIT),
    "loadtests": (None, BENCH_FUNCTION_LIMIT),
}


def oversized(source: str, path: str, module_limit: int | None, function_limit: int) -> list[str]:
    """The offenders in one module's source, each as `path:line name (N lines)`: the module
    itself (name `<module>`) when longer than module_limit, and every function or method
    longer than function_limit, methods named Class.method."""
    offenders = []
    lines = len(source.splitlines())
    if module_limit is not None and lines > module_limit:
        offenders.append(f"{path}:1 <module> ({lines} lines)")

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                name = prefix + child.name
                size = (child.end_lineno or child.lineno) - child.lineno + 1
                if size > function_limit:
                    offenders.append(f"{path}:{child.lineno} {name} ({size} lines)")
                visit(child, name + ".")
            elif isinstance(child, ast.ClassDef):
                visit(child, prefix + child.name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source, filename=path), "")
    return offenders


@pytest.mark.parametrize("folder", sorted(LIMITS))
def test_modules_and_functions_fit_their_limits(folder):
    module_limit, function_limit = LIMITS[folder]
    files = sorted((ROOT / folder).rglob("*.py"))
    assert files, f"no Python files under {folder}/"
    offenders = []
    for file in files:
        rel = file.relative_to(ROOT).as_posix()
        offenders += oversized(file.read_text(encoding="utf-8"), rel, module_limit, function_limit)
    limits = f"modules at most {module_limit} lines, " if module_limit is not None else ""
    if offenders:
        pytest.fail(f"{folder}/: {limits}functions at most {function_limit} lines; over:\n  "
                    + "\n  ".join(offenders), pytrace=False)


def _function(name: str, body_lines: int, indent: str = "") -> str:
    body = "".join(f"{indent}    x{i} = {i}\n" for i in range(body_lines))
    return f"{indent}def {name}():\n{body}"


def test_the_measure_finds_long_functions_methods_and_modules():
    source = (
        "@decorator\n"                                   # decorators do not count
        + _function("fits", 3)                           # lines 2-5: 4 lines
        + "class Box:\n"                                 # line 6
        + "    @staticmethod\n"
        + _function("too_long", 4, indent="    ")        # lines 8-12: 5 lines
        + "async def outer():\n"                         # line 13
        + _function("inner", 4, indent="    ")           # lines 14-18: 5 lines
    )
    assert oversized(source, "m.py", None, 4) == [
        "m.py:8 Box.too_long (5 lines)",
        "m.py:13 outer (6 lines)",
        "m.py:14 outer.inner (5 lines)",
    ]
    assert oversized(source, "m.py", None, 6) == []
    assert oversized(source, "m.py", 17, 6) == ["m.py:1 <module> (18 lines)"]
    assert oversized(source, "m.py", 18, 6) == []
