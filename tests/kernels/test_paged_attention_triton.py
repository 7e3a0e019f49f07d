"""The Triton paged-attention kernels (kernels/paged_attention/triton.py) against the
plain-torch reference, on the CPU under Triton's interpreter (TRITON_INTERPRET=1, the
default here), or compiled on CUDA tensors with TRITON_INTERPRET=0 (scripts/device-check.sh;
DEVICE, tests/kernels/device.py): mixed prefill chunks and decodes, odd lengths, GQA
groups, block sizes 8/16/32, float32/float16/bfloat16, a head size that is not a power of
two, scattered and non-contiguous tables, split-K decodes, caches past 2**31 elements;
write_kv_cache; how LOCKGATE_KERNELS picks them; and the engine's greedy output on them
equal to HF's (on CUDA, where the engine's device "auto" finds one).
TRITON_INTERPRET=1 is set before triton is imported (here and in tests/kernels/conftest.py).
Inputs come from CPU generators and are moved to DEVICE; the reference runs on CPU copies
of them, and the kernels' outputs are compared there.

Tolerances: float32 1e-5 (rtol and atol). float16 and bfloat16 against the reference run
in float32 on the same (rounded) inputs, so that they measure the kernel's own rounding
(probabilities rounded to the input type before P @ V, the output rounded once): float16
atol 2e-3, rtol 1e-2; bfloat16 atol 2e-2, rtol 2e-2. Outputs are O(1) (unit-normal
inputs). Each launch stays at 64 programs or fewer: the interpreter runs them one by one.
The cache past 2**31 elements is a CPU-only test (it needs untouched virtual memory).
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")   # before triton is imported (also tests/kernels/conftest.py)

import subprocess
import sys

import pytest
import torch

from lockgate.kernels import dispatch

pytest.importorskip("triton")

from lockgate.kernels.paged_attention import cpu, implementation, reference
from lockgate.kernels.paged_attention import paged_attention as dispatched_attention
from lockgate.kernels.paged_attention import triton as tk
from lockgate.kernels.paged_attention import write_kv_cache as dispatched_write
from tests.kernels.device import DEVICE, needs_device

needs_device()

TOL = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.float16: {"rtol": 1e-2, "atol": 2e-3},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}
DTYPES = list(TOL)
# (context after the step, new queries): decodes of many lengths and prefill chunks, whole
# prompts (q == ctx) and later chunks (q < ctx), around block edges
MIXED = [(1, 1), (17, 1), (33, 1), (100, 1), (33, 33), (64, 17), (17, 17), (3, 2), (50, 33)]


@pytest.fixture(autouse=True)
def default_kernel_choice(monkeypatch):
    monkeypatch.delenv("LOCKGATE_KERNELS", raising=False)


def make_case(seqs, block_size, heads, head_dim, num_blocks, dtype=torch.float32, seed=0, cache=None,
              table_from=0):
    """Caches (NaN where unwritten, unless `cache` is given) holding each sequence's context
    in scattered blocks drawn from [table_from, num_blocks); queries; tables; lengths. Built
    on the CPU (a CPU generator), returned on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    num_heads, num_kv_heads = heads
    if cache is None:
        kc = torch.full((num_kv_heads, num_blocks, block_size, head_dim), float("nan"), dtype=dtype)
        vc = torch.full_like(kc, float("nan"))
    else:
        kc, vc = cache
    free = (table_from + torch.randperm(num_blocks - table_from, generator=g)).tolist()
    tables = []
    for ctx, _ in seqs:
        tables.append([free.pop() for _ in range(-(-ctx // block_size))])
        k = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        v = torch.randn(ctx, num_kv_heads, head_dim, generator=g).to(dtype)
        t = tables[-1]
        slots = torch.tensor([t[p // block_size] * block_size + p % block_size for p in range(ctx)], dtype=torch.long)
        reference.write_kv_cache(k, v, kc, vc, slots)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long)
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    q = torch.randn(starts[-1], num_heads, head_dim, generator=g).to(dtype)
    case = q, kc, vc, bt, torch.tensor([c for c, _ in seqs]), torch.tensor(starts)
    return tuple(t.to(DEVICE) for t in case)


def check(q, kc, vc, bt, lens, starts, **kwargs):
    """Triton (on DEVICE) against the reference (on CPU copies, in float32 for the half
    types); returns the output, on DEVICE."""
    scale = q.shape[-1] ** -0.5
    got = tk.paged_attention(q, kc, vc, bt, lens, starts, scale)
    want = reference.paged_attention(*(t.float().cpu() for t in (q, kc, vc)), *(t.cpu() for t in (bt, lens, starts)),
                                     scale)
    assert got.dtype == q.dtype and got.shape == q.shape and got.device == q.device
    assert not torch.isnan(got).any()
    torch.testing.assert_close(got.float().cpu(), want, **(kwargs or TOL[q.dtype]))
    return got


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_each_dtype_and_block_size(dtype, block_size):
    check(*make_case(MIXED, block_size, (4, 2), 64, 120, dtype))


@pytest.mark.parametrize("heads", [(3, 3), (8, 1), (6, 2), (8, 2)], ids=lambda h: f"{h[0]}q{h[1]}kv")
def test_gqa_groups_and_a_head_size_that_is_not_a_power_of_two(heads):
    check(*make_case(MIXED, 16, heads, 48, 120))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decodes_only(dtype):
    # as many queries as sequences: one query per tile, group heads as rows
    seqs = [(1, 1), (17, 1), (33, 1), (100, 1), (257, 1), (16, 1)]
    check(*make_case(seqs, 16, (8, 2), 64, 60, dtype, seed=1))


def test_sequences_without_queries_and_a_batch_shaped_like_decodes():
    # 3 queries for 3 sequences, not one each: the decode tiling still places them exactly
    q, kc, vc, bt, lens, starts = make_case([(10, 0), (20, 2), (7, 1)], 8, (4, 2), 16, 20)
    check(q, kc, vc, bt, lens, starts)
    # and among prefill chunks
    check(*make_case([(10, 0), (40, 20), (9, 0), (5, 1), (30, 30)], 8, (4, 2), 16, 40))


def test_non_contiguous_query_and_table():
    q, kc, vc, bt, lens, starts = make_case(MIXED, 16, (4, 2), 32, 120, seed=2)
    # the query a view into a fused QKV row, as the engine passes it; a column slice of a wider table
    fused = torch.randn(q.shape[0], 3, 4, 32).to(DEVICE)
    fused[:, 1] = q
    wide = torch.cat([bt, torch.full((bt.shape[0], 5), 10**6, device=DEVICE)], 1)
    got = check(fused[:, 1], kc, vc, wide[:, : bt.shape[1]], lens, starts)
    assert got.is_contiguous()
    # a transposed table: stride along the blocks is not 1
    check(q, kc, vc, bt.t().contiguous().t(), lens, starts)


def test_long_contexts():
    # 32k and 8k decodes beside a chunk late in a 5k context (prefill tiles)
    check(*make_case([(32768, 1), (8191, 1), (5000, 40)], 32, (4, 1), 16, 1500, seed=3))
    # the decodes alone: 2 programs, so split-K at the default sizes (16 pieces of 2k)
    assert tk.num_splits(2, 32768) == 16
    check(*make_case([(32768, 1), (8191, 1)], 32, (4, 1), 16, 1300, seed=3))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_split_k_decodes(dtype, monkeypatch):
    # small contexts split into 8 pieces (at least 32 tokens each); pieces past a short
    # context see nothing and must weigh nothing in the merge
    monkeypatch.setattr(tk, "MIN_SPLIT_TOKENS", 32)
    monkeypatch.setattr(tk, "MAX_SPLITS", 8)
    chosen = []
    real = tk.num_splits
    monkeypatch.setattr(tk, "num_splits", lambda *a: chosen.append(real(*a)) or chosen[-1])
    seqs = [(1000, 1), (33, 1), (1, 1), (517, 1)]
    check(*make_case(seqs, 16, (4, 2), 32, 200, dtype, seed=4))
    assert chosen == [8]          # 4 decodes x 2 KV heads x 8 pieces: 64 programs


def test_split_count():
    assert tk.num_splits(64 * 8, 4096) == 1                    # a full grid
    assert tk.num_splits(4 * 8, 32768) == 8                    # 32 programs -> 256
    assert tk.num_splits(1, 32768) == tk.MAX_SPLITS
    assert tk.num_splits(1, 1000) == 1                         # under two pieces of 512
    assert tk.num_splits(3, 100_000) == 64 // 4 and tk.num_splits(100, 100_000) == 2


@pytest.mark.skipif(DEVICE.type == "cuda", reason="relies on torch.empty leaving 2 x 8.6 GB of CPU memory "
                    "untouched (only the pages used are allocated); on a GPU the caches would be real memory")
def test_caches_past_2_31_elements():
    # two KV heads of 2**23 + 64 blocks x 16 x 16: head 1 starts past 2**31 elements and the
    # tables use the top blocks, so int32 offsets would wrap (and the interpreter would read
    # outside the cache: a crash). torch.empty maps the 2 x 8.6 GB without touching it: only
    # the pages written and read are ever allocated.
    num_blocks, block_size, head_dim = 2**23 + 64, 16, 16
    shape = (2, num_blocks, block_size, head_dim)
    kc, vc = torch.empty(shape, dtype=torch.float16), torch.empty(shape, dtype=torch.float16)
    assert kc.stride(0) > 2**31 and (num_blocks - 64) * kc.stride(1) > 2**31 - 2**20
    seqs = [(40, 1), (33, 33), (17, 1), (100, 3)]
    case = make_case(seqs, block_size, (4, 2), head_dim, num_blocks, torch.float16, cache=(kc, vc),
                     table_from=num_blocks - 64)
    q, kc, vc, bt, lens, starts = case
    top = num_blocks - 64
    assert int(bt[bt > 0].min()) >= top      # 0: a table's padding, never read
    got = tk.paged_attention(q, kc, vc, bt, lens, starts, 0.25)
    # the reference on the top blocks alone (the whole cache in float32 would be 34 GB)
    want = reference.paged_attention(q.float(), kc[:, top:].float(), vc[:, top:].float(), (bt - top).clamp(min=0),
                                     lens, starts, 0.25)
    torch.testing.assert_close(got.float(), want, **TOL[torch.float16])
    # write_kv_cache at the top slots too: read back through the slots
    slots = torch.tensor([(num_blocks - 1) * block_size + 15, (num_blocks - 2) * block_size, 5])
    k = torch.randn(3, 2, head_dim).half()
    v = torch.randn(3, 2, head_dim).half()
    tk.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.view(2, -1, head_dim)[:, slots], k.transpose(0, 1))
    assert torch.equal(vc.view(2, -1, head_dim)[:, slots], v.transpose(0, 1))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_kv_cache_matches_the_reference(dtype):
    g = torch.Generator().manual_seed(5)
    num_kv_heads, num_blocks, block_size, head_dim, n = 3, 12, 8, 48, 37
    kc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    vc = torch.randn(num_kv_heads, num_blocks, block_size, head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n]
    # K and V as the engine has them: views into a fused row (not contiguous)
    fused = torch.randn(n, 3, num_kv_heads, head_dim, generator=g).to(dtype)
    # the reference on the CPU tensors, the kernel on DEVICE copies (the same tensors on the CPU)
    want_k, want_v = kc.clone(), vc.clone()
    reference.write_kv_cache(fused[:, 1], fused[:, 2], want_k, want_v, slots)
    kc, vc, fused, slots = (t.to(DEVICE) for t in (kc, vc, fused, slots))
    k, v = fused[:, 1], fused[:, 2]
    tk.write_kv_cache(k, v, kc, vc, slots)
    assert torch.equal(kc.cpu(), want_k) and torch.equal(vc.cpu(), want_v)
    # a negative slot is skipped (a padding token)
    tk.write_kv_cache(k[:2] * 0, v[:2] * 0, kc, vc, torch.tensor([-1, int(slots[0])], device=DEVICE))
    slots = slots.cpu()
    rows, want_rows = kc.cpu().view(num_kv_heads, -1, head_dim), want_k.view(num_kv_heads, -1, head_dim)
    assert torch.equal(rows[:, slots[0]], torch.zeros(num_kv_heads, head_dim, dtype=dtype))
    assert torch.equal(rows[:, slots[1:]], want_rows[:, slots[1:]])


def test_refuses_what_it_cannot_run():
    q, kc, vc, bt, lens, starts = make_case([(5, 1)], 8, (4, 2), 16, 4)
    with pytest.raises(TypeError, match="float64 is not supported"):
        tk.paged_attention(q.double(), kc.double(), vc.double(), bt, lens, starts, 0.25)
    with pytest.raises(TypeError, match="caches"):
        tk.paged_attention(q.half(), kc, vc, bt, lens, starts, 0.25)
    with pytest.raises(ValueError, match="3 query heads over 2 KV heads"):
        tk.paged_attention(q[:, :3], kc, vc, bt, lens, starts, 0.25)
    assert tk.paged_attention(q[:0], kc, vc, bt[:0], lens[:0], starts[:1], 0.25).shape == (0, 4, 16)


# -- choosing the path -----------------------------------------------------------------------

def test_lockgate_kernels_triton_takes_the_kernels(monkeypatch):
    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    for dtype in DTYPES:
        assert implementation(DEVICE, dtype) == "triton"
    assert cpu.available() is False                 # asking for triton builds no CPU kernel
    calls = []
    for name in ("paged_attention", "write_kv_cache"):
        real = getattr(tk, name)
        monkeypatch.setattr(tk, name, lambda *a, _real=real, _name=name, **kw: calls.append(_name) or _real(*a, **kw))
    q, kc, vc, bt, lens, starts = make_case(MIXED[:4], 8, (4, 2), 16, 40)
    dispatched_write(torch.randn(2, 2, 16).to(DEVICE), torch.randn(2, 2, 16).to(DEVICE), kc, vc,
                     torch.tensor([0, 1], device=DEVICE))
    got = dispatched_attention(q, kc, vc, bt, lens, starts, 0.25)
    want = reference.paged_attention(*(t.cpu() for t in (q, kc, vc, bt, lens, starts)), 0.25)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)
    assert calls == ["write_kv_cache", "paged_attention"]


def test_lockgate_kernels_triton_without_a_device_says_why(monkeypatch):
    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    monkeypatch.delenv("TRITON_INTERPRET")
    why = r"LOCKGATE_KERNELS=triton: .*CUDA device or TRITON_INTERPRET=1"
    with pytest.raises(dispatch.KernelUnavailable, match=why):
        implementation(torch.device("cpu"), torch.float32)
    with pytest.raises(dispatch.KernelUnavailable, match="TRITON_INTERPRET=1"):
        dispatched_write(torch.randn(1, 2, 16), torch.randn(1, 2, 16), torch.zeros(2, 1, 8, 16),
                         torch.zeros(2, 1, 8, 16), torch.tensor([0]))
    assert cpu.KernelUnavailable is dispatch.KernelUnavailable      # one exception, as cpu.py's tests expect


def test_unknown_lockgate_kernels_is_an_error(monkeypatch):
    monkeypatch.setenv("LOCKGATE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="LOCKGATE_KERNELS: must be one of reference, cpu, triton, got 'cuda'"):
        implementation(torch.device("cpu"), torch.float32)


def test_unset_the_cpu_never_takes_triton():
    assert implementation(torch.device("cpu"), torch.bfloat16) == "reference"
    assert implementation(torch.device("cpu"), torch.float32) in ("cpu", "reference")


def test_the_package_imports_without_triton():
    code = ("import sys; sys.modules['triton'] = None\n"
            "import torch\n"
            "from lockgate.kernels.paged_attention import implementation, paged_attention\n"
            "assert implementation(torch.device('cpu'), torch.bfloat16) == 'reference'\n"
            "assert 'lockgate.kernels.paged_attention.triton' not in sys.modules\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr


# -- the engine on the kernels ---------------------------------------------------------------

def test_engine_greedy_output_on_the_triton_kernels_matches_hf(monkeypatch):
    from lockgate.engine import LLM, SamplingParams
    from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, random_prompts

    monkeypatch.setenv("LOCKGATE_KERNELS", "triton")
    d = demo_model("llama")
    lens, max_tokens = [1, 17, 40], [8, 8, 6]
    prompts = random_prompts(d, lens, seed=7)
    want = [hf_greedy(d, p, m) for p, m in zip(prompts, max_tokens, strict=True)]
    calls = []
    real = tk.paged_attention
    monkeypatch.setattr(tk, "paged_attention", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    # a small token budget: prompts are chunked, and chunks run beside decodes
    llm = LLM(d, block_size=8, max_num_batched_tokens=24)
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert calls, "the engine did not run the Triton kernel"
    assert_all_blocks_free(llm.engine)


# -- the bench's cases -----------------------------------------------------------------------

def test_bench_cases_quick_run_and_agree():
    from lockgate.kernels.paged_attention import bench

    found = bench.cases(DEVICE, torch.float32, quick=True)
    assert [c.bound for c in found] == ["memory", "memory", "compute"]
    for case in found:
        assert case.kernel == "paged_attention" and case.name.endswith("fp32")
        assert case.bytes_moved > 0 and case.flops > 0
        torch.testing.assert_close(case.triton(), case.reference(), rtol=1e-5, atol=1e-5)


def test_bench_full_shapes_and_their_work():
    from lockgate.kernels.paged_attention import bench

    shapes = {s.name: s for s in bench._shapes(quick=False)}
    assert set(shapes) == {"decode b64 ctx4096", "decode b4 ctx32k gqa8", "prefill b4 chunk512 ctx2048 gqa8"}
    decode = shapes["decode b64 ctx4096"]
    # bf16: K and V of 64 x 4096 tokens x 32 heads x 128, plus q and out; 4 * H * ctx * D per sequence
    assert bench._work(decode, 2) == (2 * 64 * 4096 * 32 * 128 * 2 + 2 * 64 * 32 * 128 * 2, 64 * 4 * 32 * 4096 * 128)
    prefill = shapes["prefill b4 chunk512 ctx2048 gqa8"]
    keys_seen = 4 * sum(2048 - 512 + i + 1 for i in range(512))
    assert bench._work(prefill, 2)[1] == 4 * 32 * 128 * keys_seen
    assert tk.num_splits(4 * 8, 32768) > 1          # the long decode takes the split-K path


# -- the compiled kernels --------------------------------------------------------------------

COMPILE_FOR_CUDA = r'''
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from lockgate.kernels.paged_attention import triton as tk

def compile(fn, consts, ptrs, i64=(), floats=()):
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "*fp16") if n.endswith("_ptr") else
           "fp32" if n in floats else "i64" if n in i64 else "i32" for n in fn.arg_names}
    kernel = triton.compile(ASTSource(fn, sig, consts), target=GPUTarget("cuda", 90, 32))
    assert kernel.metadata.shared <= 99 * 1024, (consts, kernel.metadata.shared)   # fits sm_86/89 too

TYPES = {torch.float16: "fp16", torch.bfloat16: "bf16", torch.float32: "fp32"}
index = {"bt_ptr": "*i64", "seq_lens_ptr": "*i64", "qsl_ptr": "*i64", "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32"}
# the launcher's own choices: (tokens, seqs, heads, kv heads, head dim, block size, dtype, longest context)
for batch in ((4, 4, 32, 8, 128, 16, torch.float16, 32768),      # long decodes: split-K
              (64, 64, 32, 32, 128, 16, torch.bfloat16, 4096),   # decodes, MHA
              (64, 64, 32, 1, 128, 16, torch.bfloat16, 4096),    # decodes, MQA (32 rows)
              (100, 5, 6, 2, 48, 8, torch.bfloat16, 512),        # prefill: GQA 3, head 48, block 8
              (100, 5, 8, 2, 128, 32, torch.float32, 512),       # prefill fp32: IEEE dots
              (100, 5, 8, 8, 256, 16, torch.bfloat16, 512)):     # head 256
    tiles, splits, meta = tk.launch_config(*batch)
    assert batch[0] != 4 or splits > 1
    dt = TYPES[batch[6]]
    ptrs = dict(index, **{p: "*" + dt for p in ("out_ptr", "q_ptr", "k_ptr", "v_ptr")})
    compile(tk._attention_kernel, meta, ptrs, i64={"stride_kh", "stride_vh"}, floats={"scale_log2"})
compile(tk._merge_splits_kernel, dict(NUM_SPLITS=8, HEAD_DIM=48, HEAD_DIM_PAD=64),
        {"out_ptr": "*bf16", "part_out_ptr": "*fp32", "part_ml_ptr": "*fp32"})
compile(tk._write_kv_kernel, dict(BLOCK_T=tk.WRITE_BLOCK_T, BLOCK_SIZE=16, HEAD_DIM=48, HEAD_DIM_PAD=64),
        {"slots_ptr": "*i64"}, i64={"stride_kch", "stride_vch"})
# compiled kernels (TRITON_INTERPRET unset at import) refuse CPU tensors, saying why
from lockgate.kernels.dispatch import KernelUnavailable
try:
    tk.write_kv_cache(torch.zeros(1, 1, 16), torch.zeros(1, 1, 16), torch.zeros(1, 1, 8, 16),
                      torch.zeros(1, 1, 8, 16), torch.zeros(1, dtype=torch.long))
except KernelUnavailable as exc:
    assert "set it before triton is imported" in str(exc), exc
else:
    raise AssertionError("compiled kernels ran on CPU tensors")
print("compiled")
'''


def test_kernels_compile_for_sm90(tmp_path):
    # no GPU here: Triton's compiler lowers the kernels, at the launcher's own choices of
    # tiles, to a cubin for sm_90 (H100/H200) all the same (it needs no device), which
    # catches what the interpreter lets through: types of loop-carried values, constexpr
    # branches, tl.dot's operand rules, shared memory per program
    import triton.backends

    if "nvidia" not in triton.backends.backends:
        pytest.skip("triton has no NVIDIA backend here")
    env = dict(os.environ, TRITON_INTERPRET="0", TRITON_CACHE_DIR=str(tmp_path), TRITON_DEFAULT_FP_FUSION="1")
    done = subprocess.run([sys.executable, "-c", COMPILE_FOR_CUDA], capture_output=True, text=True, timeout=300,
                          env=env, check=False)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
