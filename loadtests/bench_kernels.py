"""`lockgate bench kernels`: every device kernel at the shapes that matter, against its
baseline, with the device's own peaks measured in the same run.

- Peaks: memory bandwidth from a large copy (read + write), compute from a large matmul in
  the dtype asked (bf16 on CUDA by default); best of several, taken by this bench on this
  device, never a spec sheet.
- Cases: each kernel package's `bench.cases(device, dtype, quick)` (kernels/benchcase.py):
  the Triton call and its baseline (the plain-torch reference, or the one the target
  names), with the bytes and FLOPs the kernel must at least move and do.
- Printed per case: time of each side, the ratio, achieved GB/s and TFLOP/s, and the share
  of the peak the case is bound by (memory-bound cases against bandwidth, compute-bound
  ones against compute).
- Timing: CUDA events around each call on CUDA (after warm-up), perf_counter elsewhere; the
  median of `iters`. On the CPU the Triton side runs in Triton's interpreter
  (TRITON_INTERPRET=1, set by this command when no GPU is present), which proves the
  harness, not the speed: `--quick` shapes, and the figures say "interpreted".
"""

from __future__ import annotations

import importlib
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

KERNELS = ("paged_attention", "lora", "quant")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], object], device: torch.device, iters: int, warmup: int = 2) -> float:
    """Median seconds of one call."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times = []
    if device.type == "cuda":
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    else:
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure_peaks(device: torch.device, dtype: torch.dtype, quick: bool) -> dict[str, float]:
    """Bandwidth (bytes/s) of a large copy and FLOP/s of a large matmul, best of several."""
    n_copy = (1 << 22) if quick else (1 << 28)           # 16 MiB / 1 GiB of fp32
    src = torch.ones(n_copy, device=device)
    dst = torch.empty_like(src)
    copy_s = min(time_call(lambda: dst.copy_(src), device, 5) for _ in range(3))
    n = 512 if quick else 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = min(time_call(lambda: a @ b, device, 5) for _ in range(3))
    return {"bandwidth": 2 * n_copy * 4 / copy_s, "flops": 2 * n**3 / mm_s}


def bench_kernels(
    *,
    kernels: tuple[str, ...] = KERNELS,
    dtype_name: str | None = None,
    quick: bool | None = None,
    iters: int = 20,
    echo=print,
) -> list[dict[str, Any]]:
    cuda = torch.cuda.is_available()
    if not cuda:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    device = torch.device("cuda" if cuda else "cpu")
    quick = (not cuda) if quick is None else quick
    dtype = getattr(torch, dtype_name) if dtype_name else (torch.bfloat16 if cuda else torch.float32)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"--dtype: {dtype_name!r} is not a torch dtype")
    where = torch.cuda.get_device_name(device) if cuda else "CPU, Triton interpreted (TRITON_INTERPRET=1)"
    peaks = measure_peaks(device, dtype, quick)
    echo(f"device: {where}; measured peaks: copy {peaks['bandwidth'] / 1e9:.1f} GB/s, "
         f"{str(dtype).removeprefix('torch.')} matmul {peaks['flops'] / 1e12:.2f} TFLOP/s"
         f"{' (quick shapes)' if quick else ''}")
    if not cuda:
        iters = min(iters, 3)
    rows: list[dict[str, Any]] = []
    echo(f"{'kernel':<16}{'case':<40}{'triton ms':>11}{'baseline ms':>13}{'ratio':>8}"
         f"{'GB/s':>9}{'TFLOP/s':>9}{'of peak':>9}  baseline")
    for name in kernels:
        module = importlib.import_module(f"lockgate.kernels.{name}.bench")
        for case in module.cases(device, dtype, quick):
            t_tri = time_call(case.triton, device, iters)
            t_ref = time_call(case.reference, device, iters)
            gbs, tfs = case.bytes_moved / t_tri, case.flops / t_tri
            share = gbs / peaks["bandwidth"] if case.bound == "memory" else tfs / peaks["flops"]
            row = {"kernel": case.kernel, "case": case.name, "bound": case.bound, "triton_s": t_tri,
                   "baseline_s": t_ref, "ratio": t_ref / t_tri, "bytes_per_s": gbs, "flops_per_s": tfs,
                   "share_of_peak": share, "baseline": case.baseline}
            rows.append(row)
            echo(f"{case.kernel:<16}{case.name:<40}{t_tri * 1e3:>11.3f}{t_ref * 1e3:>13.3f}"
                 f"{row['ratio']:>7.2f}x{gbs / 1e9:>9.1f}{tfs / 1e12:>9.2f}{share * 100:>8.1f}%  "
                 f"{case.baseline} ({case.bound}-bound)")
    if not cuda:
        echo("(interpreted on the CPU: these figures prove the bench runs, they say nothing of GPU speed)")
        return rows
    echo("")
    for verdict in judge(rows):
        echo(verdict)
    return rows


# the GPU targets, each judged on the rows of the case it names
def judge(rows: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in rows:
        if r["kernel"] == "paged_attention" and r["case"].startswith("decode b64 ctx4096"):
            ok = r["share_of_peak"] >= 0.6
            out.append(f"target decode attention b64 ctx4k >= 60% of measured bandwidth: "
                       f"{r['share_of_peak'] * 100:.1f}% {'PASS' if ok else 'FAIL'}")
        elif r["kernel"] == "w4a16" and r["bound"] == "memory":
            ok = r["ratio"] >= 2.0
            out.append(f"target W4A16 {r['case']} >= 2x torch.matmul on the dequantized weight: "
                       f"{r['ratio']:.2f}x {'PASS' if ok else 'FAIL'}")
        elif r["kernel"] == "lora" and r["baseline"] == "base layer without LoRA":
            added = r["triton_s"] / r["baseline_s"] - 1
            out.append(f"target LoRA at 8 adapters adds <= 15% to a 7B-shaped decode layer: "
                       f"+{added * 100:.1f}% {'PASS' if added <= 0.15 else 'FAIL'}")
    return out
