"""The distribution lives beside the ecosystem: one top-level import name, `lockgate`, in the
wheel; Hugging Face's top-level `kernels` is the one `import kernels` finds, here too, where
the checkout is on sys.path; the checkout's folders import under no second name."""

from __future__ import annotations

import importlib.metadata as md
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_installs_one_top_level_name(tmp_path):
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(ROOT)], check=True, timeout=300)
    (wheel,) = tmp_path.glob("lockgate-*.whl")
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"lockgate"}
    for must in ("lockgate/__init__.py", "lockgate/engine/scheduler.py", "lockgate/kernels/linear/csrc/linear.c",
                 "lockgate/kernels/csrc/lg_exp.h", "lockgate/tenancy/limiter/limiter.lua",
                 "lockgate/migrations/alembic.ini", "lockgate/loadtests/cli.py", "lockgate/gateway/cli.py",
                 "lockgate/gateway/console/templates/base.html", "lockgate/gateway/console/templates/tenant.html",
                 "lockgate/gateway/console/static/console.css", "lockgate/gateway/console/static/console.js"):
        assert must in names, must
    entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    with zipfile.ZipFile(wheel) as z:
        text = z.read(entry_points).decode()
    assert "lockgate = lockgate.gateway.cli:app" in text
    assert "bench = lockgate.loadtests.cli:bench_app" in text


def test_import_kernels_is_hugging_faces_where_installed():
    try:
        dist = md.distribution("kernels")
    except md.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels is not installed here")
    import kernels

    assert hasattr(kernels, "get_kernel")
    assert Path(kernels.__file__).resolve() == Path(dist.locate_file("kernels/__init__.py")).resolve()
    assert not (ROOT / "kernels" / "__init__.py").exists(), "a regular package would shadow it"


@pytest.mark.parametrize("bare", ["engine", "gateway", "tenancy", "migrations", "loadtests"])
def test_a_folder_does_not_import_under_its_bare_name(bare):
    with pytest.raises(ImportError, match=f"import it as 'lockgate.{bare}'|No module named '{bare}'"):
        __import__(bare)
    assert bare not in sys.modules


def test_no_module_is_loaded_under_two_names():
    import lockgate.engine
    import lockgate.gateway.app
    import lockgate.loadtests.cli  # noqa: F401

    seen: dict[Path, str] = {}
    for name, mod in list(sys.modules.items()):
        file = getattr(mod, "__file__", None)
        if not file:
            continue
        path = Path(file).resolve()
        # a venv inside the checkout holds other distributions; some modules name no real file
        if ROOT in path.parents and path.is_file() and ".venv" not in path.relative_to(ROOT).parts:
            assert path not in seen, f"{path} loaded as {seen[path]} and as {name}"
            seen[path] = name
            assert name.startswith(("lockgate", "tests")) or name == "conftest", name
    assert any(n.startswith("lockgate.engine.") for n in seen.values())


def test_lockgate_version():
    out = subprocess.run([sys.executable, "-m", "lockgate", "--version"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == f"lockgate {md.version('lockgate')}"
