"""Bench cases of the multi-LoRA kernels (`lockgate bench kernels`): 7B-shaped decode steps.

* per-projection cases: the LoRA delta of four q/k/v/o-like projections (hidden -> hidden,
  each with its own adapter weights) for a decode batch whose tokens use 8 adapters, by the
  BGMV (per-token slots) and SGMV (one segment per adapter) kernels against the reference.
  Bound "memory": the least a call must move is the A and B of the adapters the batch uses,
  x, and out read and written back.
* `decode_layer_overhead`: a decoder layer's linear work, fused qkv, o, fused gate/up and
  down, with the LoRA deltas of all seven projections (into their slices of the fused
  outputs) against the same matmuls without LoRA, baseline "base layer without LoRA". The
  GPU target: LoRA at 8 adapters adds at most 15% to a 7B-shaped decode step, i.e.
  triton time / reference time <= 1.15 for this case (the bench's ratio column, reference
  time / triton time, >= 0.87).

quick=True shrinks every shape so that a case runs in a second or two under Triton's
interpreter. The Triton module is imported on the first call of a `triton` closure, so the
cases can be built where triton is not installed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from lockgate.kernels.benchcase import BenchCase
from lockgate.kernels.lora import reference


@functools.cache
def _triton() -> ModuleType:
    from lockgate.kernels.lora import triton as triton_impl
    return triton_impl


@dataclass(frozen=True, slots=True)
class _Shape:
    hidden: int
    intermediate: int
    q_size: int
    kv_size: int
    num_adapters: int


_7B = _Shape(hidden=4096, intermediate=11008, q_size=4096, kv_size=4096, num_adapters=8)
_QUICK = _Shape(hidden=64, intermediate=160, q_size=64, kv_size=32, num_adapters=4)


def _adapters(num_slots: int, rank: int, in_f: int, out_f: int, dtype: torch.dtype, device: torch.device,
              g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """lora_a [slots, rank, in] and lora_b [slots, out, rank], PEFT-like magnitudes."""
    a = torch.randn(num_slots, rank, in_f, generator=g) / in_f ** 0.5
    b = torch.randn(num_slots, out_f, rank, generator=g) / rank ** 0.5
    return a.to(device, dtype), b.to(device, dtype)


def _proj_cost(tokens: int, used: int, rank: int, in_f: int, out_f: int, esize: int) -> tuple[int, int]:
    """(bytes, flops) of one projection's LoRA delta: the used adapters' A and B, x, and
    out read and written; a shrink and an expand multiply-add per token."""
    bytes_moved = used * rank * (in_f + out_f) * esize + tokens * in_f * esize + 2 * tokens * out_f * esize
    return bytes_moved, 2 * tokens * rank * (in_f + out_f)


def _projection_case(form: str, tokens: int, rank: int, shape: _Shape, device: torch.device, dtype: torch.dtype,
                     seed: int) -> BenchCase:
    """LoRA deltas of 4 hidden -> hidden projections (q/k/v/o-like), `form` "bgmv" or "sgmv"."""
    g = torch.Generator().manual_seed(seed)
    hidden, n = shape.hidden, shape.num_adapters
    weights = [_adapters(n, rank, hidden, hidden, dtype, device, g) for _ in range(4)]
    weights_t = [(a, b.transpose(1, 2).contiguous()) for a, b in weights]
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    out = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    scaling = torch.full((n,), 2.0, device=device)
    scales = scaling.tolist()
    per_seg = tokens // n
    seg_starts = [i * per_seg for i in range(n)] + [tokens]
    seg_slots = list(range(n))
    # decode: each token's sequence has its own adapter, in no particular order
    slots = (torch.arange(tokens) % n)[torch.randperm(tokens, generator=g)].to(device)
    if form == "bgmv":
        def triton_call() -> object:
            tk = _triton()
            for a, b in weights:
                tk.lora_shrink_expand(x, out, a, b, slots, scaling)
            return out

        def reference_call() -> object:
            for a, b in weights:
                reference.lora_shrink_expand(x, out, a, b, slots, scaling)
            return out
    else:
        def triton_call() -> object:
            tk = _triton()
            for a, bt in weights_t:
                tk.sgmv(x, out, a, bt, seg_starts, seg_slots, scales)
            return out

        def reference_call() -> object:
            for a, bt in weights_t:
                reference.sgmv(x, out, a, bt, seg_starts, seg_slots, scales)
            return out
    esize = torch.empty((), dtype=dtype).element_size()
    bytes_one, flops_one = _proj_cost(tokens, n, rank, hidden, hidden, esize)
    dname = str(dtype).removeprefix("torch.")
    return BenchCase(
        kernel="lora",
        name=f"{form} b{tokens} x{n} r{rank} qkvo {hidden} {dname}",
        bound="memory", bytes_moved=4 * bytes_one, flops=4 * flops_one,
        triton=triton_call, reference=reference_call)


def decode_layer_overhead(device: torch.device, dtype: torch.dtype, quick: bool) -> BenchCase:
    """A 7B-shaped decoder layer's matmuls (fused qkv, o, fused gate/up, down) for a decode
    batch of 32 tokens, `triton` with the BGMV LoRA deltas of all 7 projections (8 adapters of
    rank 16, each token its own adapter) added into their slices of the fused outputs,
    `reference` without LoRA (baseline "base layer without LoRA"). The target: triton time <=
    1.15 x reference time on the GPU. Attention itself is left out (a fixed tensor stands for
    its output), which makes the ratio a pessimistic bound for the whole layer."""
    shape = _QUICK if quick else _7B
    tokens, rank = (8, 8) if quick else (32, 16)
    g = torch.Generator().manual_seed(7)
    h, inter, q, kv, n = shape.hidden, shape.intermediate, shape.q_size, shape.kv_size, shape.num_adapters

    def weight(out_f: int, in_f: int) -> torch.Tensor:
        return (torch.randn(out_f, in_f, generator=g) / in_f ** 0.5).to(device, dtype)

    w_qkv, w_o = weight(q + 2 * kv, h), weight(h, q)
    w_gate_up, w_down = weight(2 * inter, h), weight(h, inter)
    x = torch.randn(tokens, h, generator=g).to(device, dtype)
    attn = torch.randn(tokens, q, generator=g).to(device, dtype)     # stands for attention's output
    act = torch.randn(tokens, inter, generator=g).to(device, dtype)  # stands for silu(gate) * up
    # (input, fused output index, out_slice, in, out) of the seven LoRA targets
    targets = [
        ("x", 0, (0, q), h, q), ("x", 0, (q, q + kv), h, kv), ("x", 0, (q + kv, q + 2 * kv), h, kv),
        ("attn", 1, (0, h), q, h),
        ("x", 2, (0, inter), h, inter), ("x", 2, (inter, 2 * inter), h, inter),
        ("act", 3, (0, h), inter, h),
    ]
    adapters = [_adapters(n, rank, in_f, out_f, dtype, device, g) for _, _, _, in_f, out_f in targets]
    scaling = torch.full((n,), 2.0, device=device)
    slots = (torch.arange(tokens) % n)[torch.randperm(tokens, generator=g)].to(device)
    inputs = {"x": x, "attn": attn, "act": act}

    def base() -> list[torch.Tensor]:
        return [F.linear(x, w_qkv), F.linear(attn, w_o), F.linear(x, w_gate_up), F.linear(act, w_down)]

    def with_lora() -> object:
        tk = _triton()
        outs = base()
        for (src, idx, out_slice, _, _), (a, b) in zip(targets, adapters, strict=True):
            tk.lora_shrink_expand(inputs[src], outs[idx], a, b, slots, scaling, out_slice)
        return outs

    esize = torch.empty((), dtype=dtype).element_size()
    base_weights = (w_qkv.numel() + w_o.numel() + w_gate_up.numel() + w_down.numel()) * esize
    base_acts = (x.numel() * 2 + attn.numel() + act.numel()) * esize \
        + tokens * (q + 2 * kv + h + 2 * inter + h) * esize
    base_flops = 2 * tokens * (w_qkv.numel() + w_o.numel() + w_gate_up.numel() + w_down.numel())
    lora_bytes = lora_flops = 0
    for _, _, _, in_f, out_f in targets:
        b_, f_ = _proj_cost(tokens, n, rank, in_f, out_f, esize)
        lora_bytes, lora_flops = lora_bytes + b_, lora_flops + f_
    dname = str(dtype).removeprefix("torch.")
    return BenchCase(
        kernel="lora",
        name=f"layer+lora b{tokens} x{n} r{rank} {h}/{inter} {dname}",
        bound="memory", bytes_moved=base_weights + base_acts + lora_bytes, flops=base_flops + lora_flops,
        triton=with_lora, reference=base, baseline="base layer without LoRA")


def cases(device: torch.device, dtype: torch.dtype, quick: bool) -> list[BenchCase]:
    """The LoRA bench cases: BGMV and SGMV decode at 8 adapters of rank 16 (batch 32 and 64),
    BGMV at rank 64, and the decoder-layer overhead case."""
    shape = _QUICK if quick else _7B
    if quick:
        plan: list[tuple[str, int, int]] = [("bgmv", 8, 8), ("sgmv", 16, 16), ("bgmv", 8, 64)]
    else:
        plan = [("bgmv", 32, 16), ("bgmv", 64, 16), ("sgmv", 64, 16), ("bgmv", 32, 64)]
    found = [_projection_case(form, tokens, rank, shape, device, dtype, seed=i)
             for i, (form, tokens, rank) in enumerate(plan)]
    return [*found, decode_layer_overhead(device, dtype, quick)]


__all__ = ["cases", "decode_layer_overhead"]
