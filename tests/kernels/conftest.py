"""The kernels' Triton paths run here on CPU tensors, in Triton's interpreter. Triton reads
TRITON_INTERPRET when it is first imported (triton.language jits its own helpers then), so
it is set before any test module of this directory imports it; TRITON_INTERPRET=0 in the
environment keeps the compiler (a CUDA machine), and the tests then put their tensors on
CUDA: DEVICE (tests/kernels/device.py, re-exported here) is the CPU when interpreting,
else CUDA."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

from tests.kernels.device import DEVICE

__all__ = ["DEVICE"]
