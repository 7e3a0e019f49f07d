"""Tensor parallelism: the model split over two rank processes (gloo on the CPU) gives the
greedy output of one rank and of HF transformers, with chunked prefill, prefix caching and
preemption all in the run; one rank spawns nothing; what cannot run is refused by name.

The rank groups are started once per shape for the whole module (a spawn costs seconds)."""

from __future__ import annotations

import asyncio
import os
import socket
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from lockgate.engine import LLM, AsyncEngine, EngineConfig, RankFailure, RankStartupError, SamplingParams
from lockgate.engine.config import ModelConfig
from lockgate.engine.kv_cache.device_cache import DeviceKVCache
from lockgate.engine.models import loader
from lockgate.engine.parallel.shard import Shard
from lockgate.engine.parallel.step_channel import StepArrays, StepReceiver, StepSender
from lockgate.engine.parallel.worker import FAULT_ENV
from tests.support.helpers import assert_all_blocks_free, demo_model, judge_greedy, random_prompts

SHAPES = [("llama", "tiny"), ("mistral", "tiny"), ("qwen2", "tiny"), ("llama", "tiny-mqa")]
# 40 fresh prompts around block edges, then 24 that extend some of them (prefix-cache hits)
FRESH_LENS = [1, 2, 5, 9, 15, 16, 17, 23, 31, 32, 33, 40, 47, 63, 64, 65, 80, 96, 100, 111,
              127, 128, 129, 150, 170, 190, 200, 210, 230, 255, 256, 257, 270, 280, 290, 299, 300, 12, 77, 140]
# a token budget of 48 chunks every prompt past it; 36 blocks of 16 (576 tokens) hold the
# longest request (300 + 32) but not the step's crowd: requests queue and are preempted
# (one thread a rank: a tiny model gains nothing from more, and loses much on a busy machine)
ENGINE_KW = {"max_num_batched_tokens": 48, "num_kv_blocks": 36, "dtype": "float32", "num_threads": 1}


def _prompts(model_dir: str) -> tuple[list[list[int]], list[int]]:
    fresh = random_prompts(model_dir, FRESH_LENS, seed=11)
    tails = random_prompts(model_dir, [3 + i % 7 for i in range(24)], seed=12)
    extended = [fresh[(5 * i) % 40] + t for i, t in enumerate(tails)]
    prompts = fresh + extended
    max_tokens = [1 + (7 * i) % 32 for i in range(len(prompts))]
    return prompts, max_tokens


def _generate(llm: LLM, prompts: list[list[int]], max_tokens: list[int]) -> list[list[int]]:
    params = [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    return [list(o.outputs[0].token_ids) for o in outs]


class RankGroups:
    """shape -> its LLM at tensor_parallel_size=2, started on first use, kept for the module."""

    def __init__(self) -> None:
        self.engines: dict[tuple[str, str], LLM] = {}

    def __call__(self, shape: tuple[str, str]) -> LLM:
        if shape not in self.engines:
            self.engines[shape] = LLM(demo_model(*shape), tensor_parallel_size=2, **ENGINE_KW)
        return self.engines[shape]

    def forget(self, shape: tuple[str, str]) -> None:
        self.engines.pop(shape, None)


@pytest.fixture(scope="module")
def tp_engines():
    groups = RankGroups()
    yield groups
    for llm in groups.engines.values():
        llm.engine.shutdown()


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "-".join(s))
def test_two_ranks_match_one_rank_and_hf(shape, tp_engines):
    """64 requests (24 extending earlier prompts), mixed max_tokens, one generate call, on
    both engines; every request HF's greedy continuation (near ties excepted) on both; and
    the run really chunked, hit the prefix cache and preempted."""
    d = demo_model(*shape)
    prompts, max_tokens = _prompts(d)
    one = LLM(d, **ENGINE_KW)
    got1 = _generate(one, prompts, max_tokens)
    two = tp_engines(shape)
    got2 = _generate(two, prompts, max_tokens)
    label = "-".join(shape)
    judge_greedy(d, prompts, got1, max_tokens, label=f"{label} N=1")
    ties = judge_greedy(d, prompts, got2, max_tokens, label=f"{label} N=2")
    assert sum(a != b for a, b in zip(got1, got2, strict=True)) <= len(ties) + 2
    for llm in (one, two):
        core = llm.engine
        assert core.scheduler.num_preemptions > 0
        assert core.kv.num_cache_hits > 0
        assert core.timings.num_steps > sum(-(-n // 48) for n in FRESH_LENS)
        assert_all_blocks_free(core)
    assert two.engine.runner.ranks is not None and len(two.engine.runner.ranks.pids) == 1
    # evicted prefixes came back from the host KV tier, each rank's heads from its own
    assert two.engine.kv.stats().host_copy_ins > 0
    # an all-reduce after the embedding and after o_proj and down in each of 2 layers, and
    # a gather where a step samples: 5 or 6 collectives a step
    group = two.engine.runner.ranks.group
    assert 5 * two.engine.timings.num_steps <= group.num_collectives <= 6 * two.engine.timings.num_steps
    assert one.engine.runner.collective_s == 0.0 < two.engine.runner.collective_s


def test_async_engine_streams_with_two_ranks_and_stops_them(tp_engines):
    """AsyncEngine(..., tensor_parallel_size=2): 6 staggered streaming requests give the
    tokens the module's LLM at N=2 gives; shutdown stops the rank process."""
    d = demo_model("qwen2")
    prompts = random_prompts(d, [3, 17, 40, 64, 90, 130], seed=14)
    want = _generate(tp_engines(("qwen2", "tiny")), prompts, [12] * 6)

    async def main():
        async with AsyncEngine(d, tensor_parallel_size=2, **ENGINE_KW) as engine:
            async def one(i):
                await asyncio.sleep(0.01 * i)
                final = None
                async for out in engine.generate({"prompt_token_ids": prompts[i]},
                                                 SamplingParams(max_tokens=12, temperature=0), f"r{i}"):
                    final = out
                return list(final.outputs[0].token_ids)
            got = await asyncio.gather(*(one(i) for i in range(6)))
            ranks = engine.core.runner.ranks
            assert engine.stats().num_requests == 0
        return got, ranks

    got, ranks = asyncio.run(main())
    assert got == want
    assert all(p.poll() is not None for p in ranks.procs) and not (_children() & set(ranks.pids))


def test_the_judge_is_not_vacuous():
    """One wrong token in an otherwise greedy output fails the check; so does an output cut
    short without an EOS."""
    d = demo_model("llama")
    prompts = random_prompts(d, [20, 40, 60], seed=13)
    got = _generate(LLM(d, dtype="float32"), prompts, [8, 8, 8])
    judge_greedy(d, prompts, got, [8, 8, 8])
    bad = [g[:] for g in got]
    bad[1][3] = (bad[1][3] + 1) % 500 + 3
    with pytest.raises(AssertionError, match="request 1: first difference at token 3"):
        judge_greedy(d, prompts, bad, [8, 8, 8])
    with pytest.raises(AssertionError, match="stopped after 7 of 8 tokens"):
        judge_greedy(d, prompts, [got[0][:7], *got[1:]], [8, 8, 8])


def test_kv_heads_split_or_replicated_and_blocks_per_rank(tp_engines):
    """Two KV heads split one per rank; the one KV head of tiny-mqa held by both ranks. The
    cache's bytes are per rank: with kv_cache_memory given, half the heads fit twice the
    blocks."""
    gqa, mqa = tp_engines(("llama", "tiny")).engine, tp_engines(("llama", "tiny-mqa")).engine
    assert gqa.runner.kv.num_kv_heads == 1 and mqa.runner.kv.num_kv_heads == 1
    assert gqa.runner.kv_caches[0][0].shape == (1, 36, 16, 16)
    cfg = ModelConfig.from_dir(demo_model("llama"))
    assert Shard(1, 2).kv_heads(cfg) == (1, 1)
    mqa_cfg = ModelConfig.from_dir(demo_model("llama", "tiny-mqa"))
    assert [Shard(r, 2).kv_heads(mqa_cfg) for r in range(2)] == [(0, 1), (0, 1)]
    assert [Shard(r, 2).vocab(509) for r in range(2)] == [(0, 255), (255, 254)]
    per_block_whole = DeviceKVCache(2, 2, 16, torch.float32, torch.device("cpu")).bytes_per_block(16)
    assert gqa.runner.bytes_per_block(16) * 2 == per_block_whole


def test_rank_reads_only_its_slices(monkeypatch):
    """Rank 1 of 2 reads every sharded tensor through get_slice (never get_tensor) and holds
    exactly its rows or columns of them."""
    d = demo_model("llama", "tiny-mqa")
    cfg = ModelConfig.from_dir(d)
    whole_reads: list[str] = []
    real_open = loader.safe_open

    class Spy:
        def __init__(self, *a, **kw):
            self.f = real_open(*a, **kw)

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def keys(self):
            return self.inner.keys()

        def get_slice(self, name):
            return self.inner.get_slice(name)

        def get_tensor(self, name):
            whole_reads.append(name)
            return self.inner.get_tensor(name)

    monkeypatch.setattr(loader, "safe_open", Spy)
    model = loader.load_model(d, cfg, 64, torch.float32, torch.device("cpu"), Shard(1, 2))
    assert whole_reads == []
    with safe_open(str(Path(d) / "model.safetensors"), framework="pt") as f:
        q = f.get_tensor("model.layers.0.self_attn.q_proj.weight")
        k = f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
        embed = f.get_tensor("model.embed_tokens.weight")
    qkv = model.layers[0].self_attn.qkv_proj.weight.data
    assert torch.equal(qkv[:32], q[32:64]) and torch.equal(qkv[32:48], k)   # heads 2-3; the one KV head
    assert torch.equal(model.layers[1].mlp.down_proj.weight.data, down[:, 64:])
    emb = model.embed_tokens.weight.data
    assert emb.shape == (255, 64) and torch.equal(emb[:254], embed[255:]) and not emb[254].any()


def test_step_channel_hands_over_each_step_and_grows():
    """A step's arrays come out on the other end as they went in; one over the 64 KiB buffer
    (20,000 tokens) moves both ends to a bigger one, and the next small step still reads."""
    ours, theirs = socket.socketpair()
    rank0, rank1 = Connection(ours.detach()), Connection(theirs.detach())
    sender, receiver = StepSender([rank1], [os.getpid()]), StepReceiver(rank1)
    sender.conns = [rank0]

    def step(num_tokens: int, num_seqs: int, width: int, seed: int) -> StepArrays:
        g = torch.Generator().manual_seed(seed)
        ints = [torch.randint(0, 1000, (n,), generator=g) for n in (num_tokens,) * 3 + (num_seqs * width,)]
        return StepArrays(*ints[:3], ints[3].view(num_seqs, width), torch.arange(num_seqs) + 1,
                          torch.arange(num_seqs + 1), torch.arange(min(num_seqs, 3)))

    for n, s, w in [(5, 2, 3), (20_000, 4, 50), (7, 1, 1)]:
        sent = step(n, s, w, seed=n)
        sender.send_step(sent)
        kind, got = receiver.decode(rank1.recv_bytes())
        assert kind == "step"
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                     "logits_indices"):
            assert torch.equal(getattr(got, name), getattr(sent, name)), name
    assert receiver.buffer is not None and receiver.buffer.size == sender.buffer.size > 1 << 16
    sender.close()
    receiver.close()


def test_one_rank_spawns_nothing_and_leaves_torch_distributed_alone():
    before = _children()
    llm = LLM(demo_model("llama"), tensor_parallel_size=1)
    llm.generate([[5, 6, 7]], SamplingParams(max_tokens=3), use_progress_bar=False)
    assert llm.engine.runner.ranks is None
    assert _children() == before
    assert not dist.is_initialized()


def test_pipeline_parallel_and_unknown_backends_are_refused_by_name():
    d = demo_model("llama")
    with pytest.raises(ValueError, match="pipeline_parallel_size"):
        EngineConfig(model=d, pipeline_parallel_size=2)
    with pytest.raises(ValueError, match="distributed_executor_backend must be 'mp' or 'ray'; got 'uni'"):
        EngineConfig(model=d, tensor_parallel_size=2, distributed_executor_backend="uni")
    ray_backed = EngineConfig(model=d, tensor_parallel_size=2, distributed_executor_backend="ray")
    assert ray_backed.distributed_executor_backend == "ray"
    with pytest.raises(ValueError, match="tensor_parallel_size: 3 does not split this model"):
        LLM(d, tensor_parallel_size=3)
    assert EngineConfig(model=d, tensor_parallel_size=2).distributed_executor_backend == "mp"


def test_rank_startup_failure_names_the_rank_and_the_cause(monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "start:1")
    before = _children()
    with pytest.raises(RankStartupError) as err:
        LLM(demo_model("llama"), tensor_parallel_size=2, rank_start_timeout_s=60)
    assert err.value.rank == 1
    assert "rank 1 failed while starting" in str(err.value) and "asked rank 1 to fail" in str(err.value)
    assert _children() == before


def test_a_dead_rank_fails_the_step_by_name(tp_engines):
    """kill -9 of rank 1: the next step raises RankFailure naming it, at once (gloo sees the
    closed connection), rather than waiting out the timeout."""
    llm = tp_engines(("mistral", "tiny"))
    pid = llm.engine.runner.ranks.pids[0]
    tp_engines.forget(("mistral", "tiny"))      # whatever runs after this starts a fresh one
    os.kill(pid, 9)
    with pytest.raises(RankFailure) as err:
        llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_progress_bar=False)
    assert err.value.rank == 1 and "rank 1" in str(err.value)
    for rid in list(llm.engine.requests):
        llm.engine.abort_request(rid)
    llm.engine.shutdown()


def _children() -> set[int]:
    """This process's child processes (Linux)."""
    out: set[int] = set()
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        text = (task / "children").read_text().split()
        out.update(int(x) for x in text)
    return out
