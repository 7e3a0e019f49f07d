"""`lockgate bench kernels` runs end to end on the CPU (Triton interpreted, quick shapes):
every kernel's cases are timed against their baselines with their work counted, and the GPU
targets are judged from the rows they name."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from lockgate.loadtests.bench_kernels import KERNELS, bench_kernels, judge
from tests.kernels.device import DEVICE


def test_every_kernel_is_benched_against_its_baseline():
    lines: list[str] = []
    rows = bench_kernels(quick=True, iters=1, echo=lines.append)
    assert {r["kernel"] for r in rows} == {"paged_attention", "lora", "w4a16"}
    assert set(KERNELS) == {"paged_attention", "lora", "quant"}
    for r in rows:
        assert r["triton_s"] > 0 and r["baseline_s"] > 0
        assert r["bound"] in ("memory", "compute")
        assert r["bytes_per_s"] > 0 and r["flops_per_s"] > 0
        assert r["share_of_peak"] > 0
    assert "GB/s" in lines[0] and "TFLOP/s" in lines[0]
    if DEVICE.type == "cpu":
        assert lines[0].startswith("device: CPU, Triton interpreted")
        assert any("say nothing of GPU speed" in line for line in lines)
    else:   # on a GPU the targets are judged
        assert sum(line.startswith("target ") for line in lines) >= 3


def test_the_gpu_targets_are_judged_from_their_rows():
    rows = [
        {"kernel": "paged_attention", "case": "decode b64 ctx4096 bf16", "bound": "memory", "share_of_peak": 0.55,
         "ratio": 3.0, "triton_s": 1.0, "baseline_s": 3.0, "baseline": "reference"},
        {"kernel": "w4a16", "case": "awq m16 k4096 n4096 g128 bfloat16", "bound": "memory", "share_of_peak": 0.5,
         "ratio": 2.4, "triton_s": 1.0, "baseline_s": 2.4, "baseline": "torch.matmul on the dequantized weight"},
        {"kernel": "w4a16", "case": "awq m64 k4096 n4096 g128 bfloat16", "bound": "compute", "share_of_peak": 0.5,
         "ratio": 0.5, "triton_s": 1.0, "baseline_s": 0.5, "baseline": "torch.matmul on the dequantized weight"},
        {"kernel": "lora", "case": "layer+lora", "bound": "memory", "share_of_peak": 0.5, "ratio": 0.8,
         "triton_s": 1.25, "baseline_s": 1.0, "baseline": "base layer without LoRA"},
    ]
    verdicts = judge(rows)
    assert len(verdicts) == 3     # the compute-bound W4A16 row has no target
    assert verdicts[0].endswith("55.0% FAIL")
    assert verdicts[1].endswith("2.40x PASS")
    assert verdicts[2].endswith("+25.0% FAIL")
