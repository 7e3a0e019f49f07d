"""The device the Triton kernel tests put the tensors their kernels get on: the CPU under
Triton's interpreter (TRITON_INTERPRET=1, tests/kernels/conftest.py's default), else CUDA,
where the kernels run compiled (scripts/device-check.sh runs tests/kernels with
TRITON_INTERPRET=0). `needs_device()` skips a test module that wants CUDA where there is none.

Inputs are still drawn from CPU generators (torch.Generator() is a CPU one) and moved here,
so both runs see the same values; the tests compare on one device, the results brought back
with .cpu() where the reference ran on the CPU."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # as tests/kernels/conftest.py, should this come first

import pytest
import torch

from lockgate.kernels.dispatch import interpreting

DEVICE = torch.device("cpu" if interpreting() else "cuda")


def needs_device() -> None:
    """Skip the calling test module when its kernels want CUDA (TRITON_INTERPRET=0) and
    there is no CUDA device here."""
    if DEVICE.type == "cuda" and not torch.cuda.is_available():
        pytest.skip("TRITON_INTERPRET is off and there is no CUDA device", allow_module_level=True)


__all__ = ["DEVICE", "needs_device"]
