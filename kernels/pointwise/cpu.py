"""A decoder layer's pointwise work on the CPU in float32 through a small C kernel
(csrc/pointwise.c, built on first use by kernels/cbuild.py): the residual add with the
RMSNorm after it in one pass, the rotary embedding of q and k with the K/V cache write in
one pass, and SiLU-and-mul, every row of a step in one call; and the sampler's argmax over
each row of logits. Each replaces several torch ops, each of which reads and writes whole
tensors and costs its own dispatch, a fixed cost that a decode step's small shapes do not
amortize."""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from lockgate.kernels.cbuild import CKernel

SOURCE = Path(__file__).with_name("csrc") / "pointwise.c"


def _declare(lib: ctypes.CDLL) -> None:
    ptr, i64, f32, i32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
    lib.lg_add_rms_norm_f32.argtypes = [ptr, ptr, ptr, f32, ptr, i64, i64, i32]
    lib.lg_add_rms_norm_f32.restype = None
    lib.lg_rope_write_kv_f32.argtypes = [ptr, i64, i64, i64, i64, i64, ptr, ptr, ptr, ptr, ptr, i64, ptr, i32]
    lib.lg_rope_write_kv_f32.restype = ctypes.c_int
    lib.lg_silu_mul_f32.argtypes = [ptr, i64, i64, i64, ptr, i32]
    lib.lg_silu_mul_f32.restype = None
    lib.lg_argmax_rows_f32.argtypes = [ptr, i64, i64, ptr, i32]
    lib.lg_argmax_rows_f32.restype = None


KERNEL = CKernel(SOURCE, "CPU pointwise kernel", _declare)


def available() -> bool:
    return KERNEL.available()


def _check(name: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        if not t.is_cpu or not t.is_contiguous():
            raise ValueError(f"{name}: CPU tensors, contiguous")
        if t.dtype != torch.float32:
            raise ValueError(f"{name}: float32 only, got {t.dtype}")


def add_rms_norm(x: torch.Tensor | None, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """As reference.add_rms_norm: residual [rows, hidden] += x in place, returns the norm."""
    _check("add_rms_norm", residual, weight, *(() if x is None else (x,)))
    if residual.dim() != 2 or weight.shape != residual.shape[1:] or (x is not None and x.shape != residual.shape):
        raise ValueError(f"add_rms_norm: residual [rows, hidden] with a weight [hidden] and x like it; got "
                         f"{tuple(residual.shape)}, {tuple(weight.shape)}, {None if x is None else tuple(x.shape)}")
    out = torch.empty_like(residual)
    KERNEL.load().lg_add_rms_norm_f32(
        None if x is None else x.data_ptr(), residual.data_ptr(), weight.data_ptr(), float(eps),
        out.data_ptr(), residual.shape[0], residual.shape[1], torch.get_num_threads())
    return out


def rope_write_kv(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, cos: torch.Tensor, sin: torch.Tensor,
                  key_cache: torch.Tensor, value_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
    """As reference.rope_write_kv."""
    d = key_cache.shape[-1]
    rows = qkv.shape[0]
    cos, sin = cos.reshape(rows, d), sin.reshape(rows, d)
    _check("rope_write_kv", qkv, cos, sin, key_cache, value_cache)
    if (qkv.dim() != 2 or qkv.shape[1] != (num_heads + 2 * num_kv_heads) * d or d % 2
            or key_cache.shape != value_cache.shape or key_cache.shape[0] != num_kv_heads):
        raise ValueError(f"rope_write_kv: qkv {tuple(qkv.shape)} does not hold {num_heads} + 2 x {num_kv_heads} "
                         f"heads of {d} for caches {tuple(key_cache.shape)}")
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.shape != (rows,):
        raise ValueError("rope_write_kv: slot_mapping, one int64 per row, contiguous")
    q = torch.empty(rows, num_heads, d)
    num_slots = key_cache.shape[1] * key_cache.shape[2]
    rc = KERNEL.load().lg_rope_write_kv_f32(
        qkv.data_ptr(), qkv.shape[1], rows, num_heads, num_kv_heads, d, cos.data_ptr(), sin.data_ptr(),
        slot_mapping.data_ptr(), key_cache.data_ptr(), value_cache.data_ptr(), num_slots, q.data_ptr(),
        torch.get_num_threads())
    if rc:
        raise ValueError(f"rope_write_kv: a slot outside the cache's {num_slots} (nothing written)")
    return q


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As reference.silu_mul: silu(gate) * up of gate_up [rows, 2 * inter]."""
    _check("silu_mul", gate_up)
    if gate_up.dim() != 2 or gate_up.shape[1] % 2:
        raise ValueError(f"silu_mul: gate_up [rows, 2 * inter], got {tuple(gate_up.shape)}")
    rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty(rows, inter)
    KERNEL.load().lg_silu_mul_f32(gate_up.data_ptr(), gate_up.shape[1], rows, inter, out.data_ptr(),
                                  torch.get_num_threads())
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """As x.argmax(dim=-1) of x [rows, cols] (the first index of the max; of the first NaN
    where a row has one): int64 [rows]. torch's CPU argmax keeps an index beside every lane
    and runs far slower than its max; this keeps each lane's first index in the same pass."""
    _check("argmax_rows", x)
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"argmax_rows: x [rows, cols >= 1], got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    KERNEL.load().lg_argmax_rows_f32(x.data_ptr(), x.shape[0], x.shape[1], out.data_ptr(),
                                     torch.get_num_threads())
    return out
