"""One case of `lockgate bench kernels`: a kernel call at a fixed shape, its Triton and
reference sides as closures over tensors made once, and the work it does (bytes moved at
minimum, FLOPs), from which the bench reports achieved bandwidth and FLOP/s and the share
of the device's peaks that it measures itself. Each kernel package's `bench.py` has
`cases(device, dtype, quick) -> list[BenchCase]`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class BenchCase:
    kernel: str                      # "paged_attention", "lora", "w4a16"
    name: str                        # the shape, in words: "decode b64 ctx4096 bf16"
    bound: str                       # "memory" or "compute": which peak this case is judged against
    bytes_moved: int                 # the least the kernel must read and write
    flops: int                       # its arithmetic (a multiply-add counts 2)
    triton: Callable[[], object]     # one call of the Triton kernel
    reference: Callable[[], object]  # one call of its reference (or the baseline the target names)
    baseline: str = "reference"      # what `reference` is, when it is not the plain reference
