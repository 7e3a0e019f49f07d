"""docs/architecture.md stays true to the code: no line over 120 characters; every module of
engine/, gateway/ and tenancy/ (but `__init__.py`) named on the page; every `.py` path the page
names exists; a picture of a request's way through (a Mermaid flowchart or an ASCII diagram).

A module is named by its path relative to its package (`serving/run.py`, `pool/replica.py`,
`limiter/redis.py`) inside that package's section of the module map (the section whose heading
names `gateway/`, say), by its full path (`gateway/serving/run.py`) anywhere, or by its file name
inside its package's section when no other module of the three packages has that name. A named
path is looked up from the repository root and from each top-level package folder (a bare file
name also at any depth, where only one file has it); a `*` in it is a glob. Names are read from
code spans and from fenced blocks (the diagram's names count). A path in a package's section is
that package's (or a full path from the root), so a stale name cannot pass as another package's."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
MAX_LINE = 120
PACKAGES = ("engine", "gateway", "tenancy")                          # each module named on the page
TOP_LEVEL = (*PACKAGES, "kernels", "loadtests", "migrations")       # where a named path may live

_FENCE = re.compile(r"^\s*(```|~~~)\s*([\w-]*)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*)$")
_SPAN = re.compile(r"`([^`\n]+)`")
_PY_PATH = re.compile(r"(?<![\w./*-])[\w*][\w./*-]*\.py(?![\w])")
_ARROW = re.compile(r"-->|->|<-|==>|-\.->")


# -- reading the page ---------------------------------------------------------------------------
def split_fences(text: str) -> tuple[list[str], list[tuple[str, str]]]:
    """The page's prose lines (outside fenced blocks; fences' own lines dropped, so line numbers
    are not kept) and its fenced blocks as (info string, body)."""
    prose: list[str] = []
    blocks: list[tuple[str, str]] = []
    info: str | None = None
    body: list[str] = []
    for line in text.splitlines():
        m = _FENCE.match(line)
        if info is None and m:
            info, body = m.group(2), []
        elif info is not None and m and not m.group(2):
            blocks.append((info, "\n".join(body)))
            info = None
        elif info is not None:
            body.append(line)
        else:
            prose.append(line)
    if info is not None:
        raise ValueError("a fenced block is never closed")
    return prose, blocks


def py_paths(lines: list[str]) -> set[str]:
    """The `.py` paths named in the code spans of `lines`."""
    return {p for line in lines for span in _SPAN.findall(line) for p in _PY_PATH.findall(span)}


def all_py_paths(text: str) -> set[str]:
    """Every `.py` path the page names: in code spans, and anywhere in its fenced blocks."""
    prose, blocks = split_fences(text)
    return py_paths(prose) | {p for _, body in blocks for p in _PY_PATH.findall(body)}


def section_lines(text: str, package: str) -> list[str]:
    """The prose lines of the sections whose heading names `package/` in a code span, each to
    the next heading of its level or above."""
    prose, _ = split_fences(text)
    out: list[str] = []
    level = 0                   # the level of the section being collected, 0: none
    for line in prose:
        m = _HEADING.match(line)
        if m and level and len(m.group(1)) <= level:
            level = 0
        if m and f"{package}/" in _SPAN.findall(m.group(2)):
            level = len(m.group(1))
        elif level:
            out.append(line)
    return out


# -- the checks ---------------------------------------------------------------------------------
def long_lines(text: str, limit: int = MAX_LINE) -> list[str]:
    return [f"line {i}: {len(line)} characters" for i, line in enumerate(text.splitlines(), 1)
            if len(line) > limit]


def unbalanced_spans(text: str) -> list[str]:
    """Prose lines with an odd number of backticks: a code span wrapped over two lines, which
    the checks would misread."""
    prose, _ = split_fences(text)
    return [line for line in prose if line.count("`") % 2]


def modules(root: Path, packages: tuple[str, ...] = PACKAGES) -> list[tuple[str, str]]:
    """(package, path relative to it) of every module but `__init__.py`."""
    out = []
    for package in packages:
        base = root / package
        out += [(package, p.relative_to(base).as_posix()) for p in sorted(base.rglob("*.py"))
                if p.name != "__init__.py" and "__pycache__" not in p.parts]
    return out


def unnamed_modules(text: str, root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """The modules of `packages` under `root` that the page does not name."""
    found = modules(root, packages)
    names = [Path(rel).name for _, rel in found]
    anywhere = all_py_paths(text)
    in_section = {package: py_paths(section_lines(text, package)) for package in packages}
    missing = []
    for package, rel in found:
        name = Path(rel).name
        named = (f"{package}/{rel}" in anywhere or rel in in_section[package]
                 or (names.count(name) == 1 and name in in_section[package]))
        if not named:
            missing.append(f"{package}/{rel}")
    return missing


def resolves(path: str, root: Path, top_level: tuple[str, ...] = TOP_LEVEL) -> bool:
    """`path` from the root or from a top-level package folder; a bare file name also where
    exactly one file of the packages, at any depth, has it."""
    bases = [root, *(root / top for top in top_level)]
    if any(any(base.glob(path)) if "*" in path else (base / path).is_file() for base in bases):
        return True
    if "/" in path or "*" in path:
        return False
    return sum(1 for top in top_level for _ in (root / top).rglob(path)) == 1


def missing_paths(text: str, root: Path, top_level: tuple[str, ...] = TOP_LEVEL) -> list[str]:
    """The `.py` paths the page names that exist neither from the root nor from a package."""
    return sorted(p for p in all_py_paths(text) if not resolves(p, root, top_level))


def misplaced_paths(text: str, root: Path, packages: tuple[str, ...] = PACKAGES) -> list[str]:
    """Paths in a package's section that are not that package's (nor full paths from the root):
    `batches.py` under `gateway/` must be the gateway's, not tenancy's."""
    return [f"{package}/: {p}" for package in packages
            for p in sorted(py_paths(section_lines(text, package))) if not resolves(p, root, (package,))]


def has_diagram(text: str) -> bool:
    """A fenced Mermaid flowchart (a `graph`/`flowchart` with edges), or a fenced ASCII picture:
    at least three lines with arrows."""
    _, blocks = split_fences(text)
    for info, body in blocks:
        if info == "mermaid" and re.search(r"^\s*(graph|flowchart)\b", body, re.M) and "--" in body:
            return True
        if info != "mermaid" and sum(bool(_ARROW.search(line)) for line in body.splitlines()) >= 3:
            return True
    return False


# -- the page -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def page() -> str:
    return DOC.read_text(encoding="utf-8")


def test_lines_fit(page):
    bad = long_lines(page)
    assert not bad, f"{DOC.name}: lines over {MAX_LINE} characters:\n" + "\n".join(bad)


def test_code_spans_do_not_wrap(page):
    bad = unbalanced_spans(page)
    assert not bad, f"{DOC.name}: a code span is split over lines:\n" + "\n".join(bad)


def test_every_module_is_named(page):
    assert modules(ROOT), "no modules found: is ROOT the repository?"
    bad = unnamed_modules(page, ROOT)
    assert not bad, (f"{DOC.name} does not name these modules (add each, with its one job, to its "
                     "package's section of the module map):\n" + "\n".join(bad))


def test_every_named_module_exists(page):
    bad = missing_paths(page, ROOT)
    assert not bad, f"{DOC.name} names modules that do not exist:\n" + "\n".join(bad)


def test_each_section_names_its_own_modules(page):
    bad = misplaced_paths(page, ROOT)
    assert not bad, (f"{DOC.name} names, in a package's section, modules that are not that package's "
                     "(write them from the root, `tenancy/limiter/redis.py`):\n" + "\n".join(bad))


def test_has_a_diagram(page):
    assert has_diagram(page), f"{DOC.name} has no diagram (a ```mermaid flowchart or an ASCII picture)"


def test_names_the_import_style(page):
    assert "from lockgate.engine import" in page


# -- the checks themselves, on small inputs -----------------------------------------------------
@pytest.fixture
def tree(tmp_path: Path) -> Path:
    for rel in ("engine/__init__.py", "engine/core.py", "engine/pool/replica.py", "gateway/errors.py",
                "gateway/serving/run.py", "tenancy/errors.py", "tenancy/limiter/redis.py",
                "loadtests/bench_a.py", "tests/test_x.py"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("")
    return tmp_path


SAMPLE = """# Sample

## Map

### `engine/`: inference

- `core.py` one job; `replica.py` its file name alone, which no other module has.

### `gateway/`

- `serving/run.py` and `errors.py` (the gateway's, not tenancy's).

### `tenancy/`

- `limiter/redis.py`.

## Elsewhere

`tenancy/errors.py` by its full path; `bench_*.py` a glob; `tests/test_x.py` from the root.
"""


def test_a_complete_page_passes(tree):
    assert unnamed_modules(SAMPLE, tree) == []
    assert missing_paths(SAMPLE, tree) == []
    assert misplaced_paths(SAMPLE, tree) == []
    assert long_lines(SAMPLE) == []
    assert unbalanced_spans(SAMPLE) == []


def test_an_unnamed_module_is_found(tree):
    (tree / "gateway" / "serving" / "new.py").write_text("")
    (tree / "engine" / "replica.py").write_text("")     # `replica.py` no longer names one module
    assert unnamed_modules(SAMPLE, tree) == ["engine/pool/replica.py", "gateway/serving/new.py"]


def test_a_name_counts_only_in_its_own_section(tree):
    text = SAMPLE.replace("`tenancy/errors.py` by its full path", "nothing")
    assert unnamed_modules(text, tree) == ["tenancy/errors.py"]     # `errors.py` is in gateway's
    text = SAMPLE.replace("### `engine/`: inference", "### engines")
    assert unnamed_modules(text, tree) == ["engine/core.py", "engine/pool/replica.py"]


def test_a_stale_path_is_found(tree):
    for op in ("lora", "quant"):
        (tree / "kernels" / op).mkdir(parents=True)
        (tree / "kernels" / op / "reference.py").write_text("")
    text = SAMPLE + ("\n`serving/gone.py`, `gateway/jobs.py`, `nope_*.py`, `run.py` (one file has it), "
                     "`reference.py` (two have it).\n```text\na -> `old.py`\n```\n")
    assert missing_paths(text, tree) == ["gateway/jobs.py", "nope_*.py", "old.py", "reference.py",
                                         "serving/gone.py"]


def test_another_packages_module_in_a_section_is_found(tree):
    assert misplaced_paths(SAMPLE, tree) == []
    text = SAMPLE.replace("`serving/run.py` and", "`serving/run.py`, `limiter/redis.py`, `tenancy/errors.py` and")
    assert missing_paths(text, tree) == []                  # each exists somewhere
    assert misplaced_paths(text, tree) == ["gateway/: limiter/redis.py"]


def test_a_long_line_is_found():
    assert long_lines("x" * 120 + "\n" + "y" * 121) == ["line 2: 121 characters"]


def test_a_wrapped_span_is_found():
    assert unbalanced_spans("a `span\nwrapped` here\n```\nodd ` inside a fence\n```\n") == [
        "a `span", "wrapped` here"]


@pytest.mark.parametrize("text, expected", [
    ("```mermaid\nflowchart TD\n  A --> B\n```\n", True),
    ("```text\nclient\n  -> route\n  -> serving\n  -> engine\n```\n", True),
    ("```text\nclient\n  |\n  v\n route --> serving -> engine\n engine <-- stream\n```\n", False),
    ("a -> b\nb -> c\nc -> d\n", False),                                  # arrows in prose, no picture
    ("```python\nx = 1\n```\n", False),
    ("```mermaid\nsequenceDiagram\n  A->>B: hi\n```\n", False),
])
def test_the_diagram_check(text, expected):
    assert has_diagram(text) is expected


def test_an_unclosed_fence_is_an_error():
    with pytest.raises(ValueError, match="never closed"):
        split_fences("```text\na -> b\n")
