"""Which implementation a kernel call takes: `reference` (plain torch, every device), `cpu`
(a compiled CPU kernel, where the op has one) or `triton` (CUDA, or any device under
`TRITON_INTERPRET=1`, Triton's interpreter, which the CPU tests use).

Unset, `LOCKGATE_KERNELS` means the best path there is: Triton on CUDA when triton imports,
the CPU kernel on the CPU where the op has one and it builds, else the reference. Set, it
overrides, and a choice that cannot be honoured fails loudly naming what is missing
(KernelUnavailable) instead of silently running something else. `cpu` on an op without a
CPU kernel runs that op's reference (the reference is its CPU path).
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Callable

import torch

_CPU = torch.device("cpu")

CHOICES = ("reference", "cpu", "triton")


class KernelUnavailable(RuntimeError):
    """A kernel path was asked for (LOCKGATE_KERNELS) and cannot run here."""


def kernel_choice() -> str | None:
    """`LOCKGATE_KERNELS` (reference, cpu or triton), or None when unset. Read on every call
    (a kernel call asks): the variable may change while the process runs."""
    return _parse_choice(os.environ.get("LOCKGATE_KERNELS", ""))


@functools.lru_cache(maxsize=16)
def _parse_choice(raw: str) -> str | None:
    value = raw.strip().lower()
    if not value:
        return None
    if value not in CHOICES:
        raise ValueError(f"LOCKGATE_KERNELS: must be one of {', '.join(CHOICES)}, got {value!r}")
    return value


def cpu_kernel_runs(available: Callable[[], bool]) -> bool:
    """For CPU tensors the caller has checked (dtype and all) for an op with a CPU kernel:
    whether the kernel runs, as `pick(cpu, has_cpu_kernel=available()) == "cpu"` answers
    (KernelUnavailable where LOCKGATE_KERNELS=triton cannot be honoured), in the unset and
    `cpu` cases without pick's other work: the per-call path of every CPU kernel."""
    choice = kernel_choice()
    if choice is None or choice == "cpu":
        return available()
    return pick(_CPU, has_cpu_kernel=available()) == "cpu"


def interpreting() -> bool:
    """Whether Triton kernels run in Triton's interpreter (TRITON_INTERPRET=1): on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET", "").strip() not in ("", "0")


@functools.cache
def _triton_import_error() -> str | None:
    try:
        import triton
        import triton.language  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no triton here"
        return f"{type(exc).__name__}: {exc}"
    return None


def triton_runs_on(device: torch.device) -> str | None:
    """None when a Triton kernel can run on tensors of this device, else why not."""
    error = _triton_import_error()
    if error is not None:
        return f"triton does not import ({error}); install it (pip install triton)"
    if device.type == "cuda" or interpreting():
        return None
    return f"Triton kernels need a CUDA device or TRITON_INTERPRET=1; these tensors are on {device.type}"


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Around a Triton launch: the launch goes to the tensors' own CUDA device (not whichever
    is current); CPU tensors need the interpreter (KernelUnavailable otherwise)."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    if not interpreting():
        raise KernelUnavailable(f"Triton kernels on {device.type} tensors run in Triton's interpreter: "
                                "set TRITON_INTERPRET=1 before triton is imported")
    return contextlib.nullcontext()


def pick(device: torch.device, has_cpu_kernel: bool = False) -> str:
    """The path a kernel call on this device takes: "reference", "cpu" or "triton".

    `has_cpu_kernel` says whether the op has a CPU kernel that runs for this call (its dtype
    and build checked by the caller). Raises KernelUnavailable when LOCKGATE_KERNELS=triton
    and Triton cannot run here."""
    choice = kernel_choice()
    if choice == "reference":
        return "reference"
    if choice == "triton":
        why = triton_runs_on(device)
        if why is not None:
            raise KernelUnavailable(f"LOCKGATE_KERNELS=triton: {why}")
        return "triton"
    if choice == "cpu":
        return "cpu" if has_cpu_kernel and device.type == "cpu" else "reference"
    if device.type == "cuda" and triton_runs_on(device) is None:
        return "triton"
    if device.type == "cpu" and has_cpu_kernel:
        return "cpu"
    return "reference"


__all__ = ["CHOICES", "KernelUnavailable", "cpu_kernel_runs", "interpreting", "kernel_choice", "on_device", "pick",
           "triton_runs_on"]
