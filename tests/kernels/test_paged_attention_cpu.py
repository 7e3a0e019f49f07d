"""The CPU decode-attention kernel (kernels/paged_attention/cpu.py) against the plain-torch
reference: odd lengths, block sizes 8/16/32, GQA groups, long contexts, block ids past 2**16,
tables scattered or consecutive, unwritten (NaN) slots never read, decodes mixed with
prefill chunks; and how the kernel is chosen, built and refused."""

from __future__ import annotations

import logging
import os
import stat

import pytest
import torch

from lockgate.kernels.paged_attention import cpu, implementation, reference, write_kv_cache


def _case(seqs, block_size, heads, head_dim, num_blocks, seed=0, scattered=True):
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    kc = torch.full((num_kv_heads, num_blocks, block_size, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))
    order = torch.randperm(num_blocks, generator=g).tolist() if scattered else list(range(num_blocks))
    tables = []
    for ctx, _ in seqs:
        n = -(-ctx // block_size)
        tables.append([order.pop() for _ in range(n)] if scattered else [order.pop(0) for _ in range(n)])
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g)
        t = tables[-1]
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(ctx)])
        write_kv_cache(k, v, kc, vc, slots)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=g)
    lens = torch.tensor([c for c, _ in seqs])
    return q, kc, vc, bt, lens, torch.tensor(starts)


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("heads", [(4, 2), (3, 3), (8, 1), (6, 2)])
@pytest.mark.parametrize("scattered", [True, False])
def test_decodes_and_chunks_match_the_reference(block_size, heads, scattered):
    seqs = [(1, 1), (17, 1), (33, 1), (33, 33), (64, 17), (129, 1), (250, 1), (3, 2), (1000, 1)]
    q, kc, vc, bt, lens, starts = _case(seqs, block_size, heads, 24, 400, scattered=scattered)
    scale = 24 ** -0.5
    want = reference.paged_attention(q, kc, vc, bt, lens, starts, scale)
    got = cpu.paged_attention(q, kc, vc, bt, lens, starts, scale)
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("heads", [(4, 2), (3, 1), (10, 2), (2, 2)])
def test_real_head_sizes_take_the_vector_paths(head_dim, heads):
    """Head sizes of real models: multiples of 8 (keys scored 8 at a time), of 64 (values 64
    columns at a time) with and without a remainder (80); query heads per KV head one, two
    (a pair), three and five (pairs and a single)."""
    seqs = [(1, 1), (7, 1), (8, 1), (9, 1), (100, 1), (257, 1), (40, 9)]
    q, kc, vc, bt, lens, starts = _case(seqs, 16, heads, head_dim, 120, seed=5)
    scale = head_dim ** -0.5
    want = reference.paged_attention(q, kc, vc, bt, lens, starts, scale)
    got = cpu.paged_attention(q, kc, vc, bt, lens, starts, scale)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_long_context_and_many_blocks():
    # 8k-token contexts, block ids near the top of a 70k-block cache
    seqs = [(8191, 1), (5000, 1), (1, 1), (4097, 1)]
    q, kc, vc, bt, lens, starts = _case(seqs, 16, (4, 2), 8, 70_000, seed=3)
    assert int(bt.max()) > 65_536
    want = reference.paged_attention(q, kc, vc, bt, lens, starts, 8 ** -0.5)
    got = cpu.paged_attention(q, kc, vc, bt, lens, starts, 8 ** -0.5)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_engine_path_is_the_kernel_on_cpu_float32_unless_turned_off(monkeypatch):
    assert implementation(torch.device("cpu"), torch.float32) == "cpu"
    assert implementation(torch.device("cpu"), torch.bfloat16) == "reference"
    monkeypatch.setenv("LOCKGATE_KERNELS", "reference")
    assert implementation(torch.device("cpu"), torch.float32) == "reference"
    monkeypatch.setenv("LOCKGATE_KERNELS", "bogus")
    with pytest.raises(ValueError, match="LOCKGATE_KERNELS: must be one of reference, cpu"):
        implementation(torch.device("cpu"), torch.float32)


def test_bad_arguments_are_refused_not_read_out_of_bounds():
    q, kc, vc, bt, lens, _ = _case([(20, 1), (9, 1)], 8, (4, 2), 16, 20)
    rows = torch.arange(2)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="float32 only"):
        cpu.decode_attention(q.double(), kc, vc, bt, rows, rows, lens, 0.25, out)
    with pytest.raises(ValueError, match="int64"):
        cpu.decode_attention(q, kc, vc, bt.int(), rows, rows, lens, 0.25, out)
    with pytest.raises(ValueError, match="contiguous"):
        cpu.decode_attention(q.transpose(0, 1), kc, vc, bt, rows, rows, lens, 0.25, out)


@pytest.fixture
def fresh_state(monkeypatch, tmp_path):
    """No kernel loaded yet in this process, and an empty cache: the next call builds."""
    monkeypatch.setattr(cpu.KERNEL, "lib", None)
    monkeypatch.setattr(cpu.KERNEL, "tried", False)
    monkeypatch.setenv("LOCKGATE_KERNEL_CACHE", str(tmp_path / "cache"))
    return tmp_path


def test_no_compiler_is_a_clear_error_when_asked_for_and_a_fallback_when_not(fresh_state, monkeypatch, caplog):
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setenv("PATH", str(fresh_state))        # no cc, no gcc
    monkeypatch.setenv("LOCKGATE_KERNELS", "cpu")
    with pytest.raises(cpu.KernelUnavailable, match="no C compiler found"):
        cpu.available()
    monkeypatch.setattr(cpu.KERNEL, "tried", False)
    monkeypatch.delenv("LOCKGATE_KERNELS")
    with caplog.at_level(logging.WARNING, logger="lockgate.kernels.cbuild"):
        assert cpu.available() is False
    assert "using the torch reference" in caplog.text
    assert implementation(torch.device("cpu"), torch.float32) == "reference"


def test_a_failing_compiler_names_its_error(fresh_state, monkeypatch):
    fake = fresh_state / "fakecc"
    fake.write_text("#!/bin/sh\necho 'fakecc: out of luck' >&2\nexit 3\n")
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("CC", str(fake))
    with pytest.raises(cpu.KernelUnavailable, match=r"exit 3.*out of luck"):
        cpu.build()
    assert not any(p.suffix == ".so" for p in (fresh_state / "cache").iterdir())   # no partial file


def test_build_is_cached_per_machine(fresh_state):
    first = cpu.build()
    mtime = os.stat(first).st_mtime_ns
    assert cpu.build() == first and os.stat(first).st_mtime_ns == mtime


def test_shapes_past_the_kernels_limits_take_the_reference_and_a_direct_call_is_refused():
    """Blocks over 256 tokens: paged_attention answers through the reference (same result);
    calling the kernel itself with them is a ValueError naming the limits."""
    if not cpu.available():
        pytest.skip("no C compiler")
    torch.manual_seed(3)
    kc, vc = torch.randn(1, 3, 512, 8), torch.randn(1, 3, 512, 8)
    q = torch.randn(2, 2, 8)
    tables = torch.tensor([[2], [0]])
    lens, starts = torch.tensor([300, 17]), torch.tensor([0, 1, 2])
    got = cpu.paged_attention(q, kc, vc, tables, lens, starts, 0.3)
    want = reference.paged_attention(q, kc, vc, tables, lens, starts, 0.3)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="blocks of at most 256"):
        cpu.decode_attention(q, kc, vc, tables, torch.arange(2), torch.arange(2), lens, 0.3, torch.empty_like(q))


def test_a_first_block_of_minus_infinity_scores_is_weighed_as_nothing():
    """Every score of the first block at -inf (keys at -inf against a positive query): the
    later keys decide, as in the reference; no NaN."""
    if not cpu.available():
        pytest.skip("no C compiler")
    torch.manual_seed(4)
    kc, vc = torch.randn(1, 4, 16, 8), torch.randn(1, 4, 16, 8)
    kc[0, 1] = float("-inf")                       # block 1 is the sequence's first
    q = torch.rand(1, 2, 8) + 0.1
    tables, lens, starts = torch.tensor([[1, 3, 0]]), torch.tensor([40]), torch.tensor([0, 1])
    got = cpu.paged_attention(q, kc, vc, tables, lens, starts, 0.5)
    want = reference.paged_attention(q, kc, vc, tables, lens, starts, 0.5)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_step_cache_serves_every_layer_of_a_forward_the_same():
    """The decodes' rows are worked out once per forward and kept in the step cache; each
    layer (another cache, another query) still gets its own right answer."""
    seqs = [(1, 1), (40, 9), (100, 1), (33, 1)]
    step_cache: dict = {}
    q0, kc0, vc0, bt, lens, starts = _case(seqs, 16, (4, 2), 64, 40, seed=1)
    g = torch.Generator().manual_seed(2)
    for layer in range(3):     # the same metadata, each layer its own cache and queries
        q = q0 + layer * torch.randn(q0.shape, generator=g)
        kc = kc0 + layer * torch.randn(kc0.shape, generator=g)
        vc = vc0 * (1 + layer)
        want = reference.paged_attention(q, kc, vc, bt, lens, starts, 0.125)
        got = cpu.paged_attention(q, kc, vc, bt, lens, starts, 0.125, None, step_cache)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert "cpu_decode_split" in step_cache


def test_a_change_to_a_shared_header_builds_anew(fresh_state, monkeypatch):
    """The sources include kernels/csrc/*.h: an edited header is another library, not the
    cached one built before it."""
    from lockgate.kernels import cbuild

    include = fresh_state / "include"
    include.mkdir()
    header = include / "lg_exp.h"
    header.write_bytes((cbuild.INCLUDE / "lg_exp.h").read_bytes())
    monkeypatch.setattr(cbuild, "INCLUDE", include)
    first = cpu.build()
    header.write_bytes(header.read_bytes() + b"\n/* edited */\n")
    second = cpu.build()
    assert second != first and first.exists() and second.exists()


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", [(4, 2), (8, 1), (2, 2), (6, 2)])
@pytest.mark.parametrize("with_decodes", [True, False])
def test_prefill_chunks_in_consecutive_slots_take_the_prefill_kernel(head_dim, heads, with_decodes):
    """Whole prompts and later chunks (a query sees keys up to its own position), contexts
    over several blocks of 64 keys and query blocks of 16, 1-8 query heads a KV head; a step
    of prefills alone and one with decodes; against the reference (SDPA)."""
    seqs = [(300, 300), (50, 17), (33, 33), (200, 64), (16, 16), (5, 2)]
    if with_decodes:
        seqs += [(40, 1), (129, 1)]
    q, kc, vc, bt, lens, starts = _case(seqs, 16, heads, head_dim, 90, seed=7, scattered=False)
    scale = head_dim ** -0.5
    want = reference.paged_attention(q, kc, vc, bt, lens, starts, scale)
    got = cpu.paged_attention(q, kc, vc, bt, lens, starts, scale, step_cache={})
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_prefill_chunk_in_scattered_blocks_takes_the_reference_beside_the_kernel(monkeypatch):
    q, kc, vc, bt, lens, starts = _case([(100, 100), (70, 30), (9, 1)], 16, (4, 2), 64, 40, seed=3, scattered=False)
    bt[1, :2] = bt[1, :2].flip(0).clone()     # the second sequence's first two blocks swapped...
    kc[:, bt[1, :2]] = kc[:, bt[1, :2].flip(0)].clone()   # ...its keys and values with them
    vc[:, bt[1, :2]] = vc[:, bt[1, :2].flip(0)].clone()
    first = reference.contiguous_first_slots(bt, lens, 16)
    assert first[0] >= 0 and first[1] == -1
    seen = []
    real = cpu.prefill_attention
    monkeypatch.setattr(cpu, "prefill_attention", lambda *a: (seen.append(a[4].tolist()), real(*a)))
    want = reference.paged_attention(q, kc, vc, bt, lens, starts, 0.125)
    torch.testing.assert_close(cpu.paged_attention(q, kc, vc, bt, lens, starts, 0.125), want, rtol=1e-5, atol=1e-5)
    assert seen == [[100]]        # the kernel took the first sequence only
    monkeypatch.setattr(cpu, "prefill_available", lambda: False)   # no prefill kernel: all the reference's
    torch.testing.assert_close(cpu.paged_attention(q, kc, vc, bt, lens, starts, 0.125), want, rtol=1e-5, atol=1e-5)


def test_the_prefill_kernel_refuses_what_it_does_not_take():
    q, kc, vc, *_ = _case([(20, 20)], 16, (4, 2), 80, 4, scattered=False)
    i64 = torch.tensor([0]), torch.tensor([20]), torch.tensor([20]), torch.tensor([0])
    with pytest.raises(ValueError, match="head sizes 64 or 128"):
        cpu.prefill_attention(q, kc, vc, *i64, 0.1, torch.empty_like(q))
    with pytest.raises(ValueError, match="int64"):
        cpu.prefill_attention(q, kc, vc, *(t.int() for t in i64), 0.1, torch.empty_like(q))
    q, kc, vc, *_ = _case([(20, 20)], 16, (4, 2), 64, 4, scattered=False)     # 64 slots
    out = torch.full_like(q, 7.0)
    for bad in ([[0], [20], [20], [50]],     # context past the cache's last slot
                [[5], [20], [20], [0]],      # query rows past the step's
                [[0], [21], [20], [0]],      # more new tokens than context
                [[0], [20], [20], [-1]]):    # a context that is not in consecutive slots
        with pytest.raises(ValueError, match="fall outside"):
            cpu.prefill_attention(q, kc, vc, *(torch.tensor(v) for v in bad), 0.1, out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="one index entry per sequence"):
        cpu.prefill_attention(q, kc, vc, torch.tensor([0, 1]), torch.tensor([20]), torch.tensor([20]),
                              torch.tensor([0]), 0.1, out)
