"""Small C kernels for the CPU: compiled on first use with the machine's C compiler (`CC`,
else cc/gcc; `-O3 -march=native -fopenmp`, ISO C so no FMA is contracted behind the
source's back) into a cache directory (`LOCKGATE_KERNEL_CACHE`, default
`~/.cache/lockgate/kernels`), keyed by the source and the shared headers of `csrc/`, the
flags, the compiler and the CPU, and
loaded with ctypes; a compile is bounded in time. OpenMP is torch's own runtime (libgomp
is already loaded by torch when a kernel is).

`CKernel` is one source file's library, built and loaded once per process: `available()`
follows LOCKGATE_KERNELS (unset: built where it builds, else logged once and the caller
runs its reference; `cpu`: a failure raises, naming what is missing; `reference`/`triton`:
not built)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

from lockgate.kernels.dispatch import KernelUnavailable, kernel_choice

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11")
INCLUDE = Path(__file__).with_name("csrc")   # headers the sources share (lg_exp.h)
COMPILE_TIMEOUT_S = 120.0


def cache_dir() -> Path:
    explicit = os.environ.get("LOCKGATE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lockgate" / "kernels"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's model and flags."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return platform.processor() or platform.machine()
    wanted = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted) or platform.machine()


def _compiler_version(cc: str) -> str:
    try:
        done = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30, check=False)  # noqa: S603
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout.splitlines()[0] if done.stdout else ""


def build(source: Path, directory: Path | None = None) -> Path:
    """The compiled library's path, compiling `source` if this machine has none yet. Raises
    KernelUnavailable naming what is missing (no compiler, a failed or slow compile)."""
    cc = _compiler()
    if cc is None:
        raise KernelUnavailable(f"no C compiler found (set CC, or install gcc): {source.name} cannot be "
                                "built; LOCKGATE_KERNELS=reference runs without it")
    # the shared headers are part of what is compiled, so of the key too
    text = b"\0".join([source.read_bytes(), *(h.read_bytes() for h in sorted(INCLUDE.glob("*.h")))])
    key = hashlib.sha256(b"\0".join([text, " ".join(FLAGS).encode(), _compiler_version(cc).encode(),
                                     _cpu_id().encode(), platform.machine().encode()])).hexdigest()[:16]
    directory = directory or cache_dir()
    target = directory / f"{source.stem}-{key}.so"
    if target.exists():
        return target
    directory.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)
    os.close(fd)
    try:
        done = subprocess.run([cc, *FLAGS, f"-I{INCLUDE}", str(source), "-o", tmp, "-lm"],  # noqa: S603
                              capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S, check=False)
        if done.returncode != 0:
            raise KernelUnavailable(f"{cc} could not compile {source.name} "
                                    f"(exit {done.returncode}): {done.stderr.strip()[-2000:]}")
        os.replace(tmp, target)     # atomic: concurrent builders each rename a whole file
    except subprocess.TimeoutExpired as exc:
        raise KernelUnavailable(f"{cc} took over {COMPILE_TIMEOUT_S:.0f} s compiling {source.name}") from exc
    except OSError as exc:
        raise KernelUnavailable(f"compiling {source.name} with {cc}: {exc}") from exc
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return target


class CKernel:
    """One C source's library: built, loaded and given its signatures (`declare(lib)`) once
    per process."""

    def __init__(self, source: Path, what: str, declare: Callable[[ctypes.CDLL], None]) -> None:
        self.source, self.what, self.declare = source, what, declare
        self.lib: ctypes.CDLL | None = None
        self.tried = False
        self._lock = threading.Lock()

    def build(self, directory: Path | None = None) -> Path:
        return build(self.source, directory)

    def load(self) -> ctypes.CDLL:
        """The library (KernelUnavailable if it cannot be had)."""
        lib = self.lib
        if lib is not None:      # loaded: no lock (every kernel call comes here)
            return lib
        with self._lock:
            if self.lib is not None:
                return self.lib
            self.tried = True
            path = self.build()
            try:
                lib = ctypes.CDLL(str(path))
            except OSError as exc:
                raise KernelUnavailable(f"loading {path}: {exc}") from exc
            self.declare(lib)
            self.lib = lib
            return lib

    def available(self) -> bool:
        """Whether this kernel runs in this process: not turned off by LOCKGATE_KERNELS, and
        built. Unset, a failed build is logged once and the reference runs; `cpu` raises;
        `reference` and `triton` ask for another path (False, and nothing is built)."""
        choice = kernel_choice()
        if choice in ("reference", "triton"):
            return False
        if self.lib is not None:
            return True
        if self.tried and choice != "cpu":
            return False
        try:
            self.load()
        except KernelUnavailable as exc:
            if choice == "cpu":
                raise
            logger.warning("%s unavailable, using the torch reference: %s", self.what, exc)
            return False
        return True
