"""`distributed_executor_backend="ray"`: ranks 1..N-1 as Ray actors of the cluster this
process is connected to (the session's local cluster), pinned to this node: the same greedy
output as one rank and HF, the rank's process is the actor's, a killed actor fails the next
step naming its rank, and shutdown leaves no rank process alive."""

from __future__ import annotations

import os
import time

import pytest

from lockgate.engine import LLM, RankFailure, SamplingParams
from tests.support.helpers import demo_model, hf_greedy, random_prompts

ray = pytest.importorskip("ray")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_ray_ranks_match_hf_and_fail_by_name(ray_cluster):
    if not ray.is_initialized():
        ray.init(address=ray_cluster.address)
    d = demo_model("llama", "tiny", 0)
    llm = LLM(d, tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32")
    try:
        prompts = random_prompts(d, [5, 17, 33], seed=11)
        sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_progress_bar=False)
        assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, 8, ignore_eos=True) for p in prompts]
        [rank] = llm.engine.runner.ranks.procs
        [pid] = llm.engine.runner.ranks.pids
        assert ray.get(rank.actor.pid.remote(), timeout=10) == pid != os.getpid()
        assert rank.poll() is None and _alive(pid)
        ray.kill(rank.actor, no_restart=True)
        with pytest.raises(RankFailure) as err:
            llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4), use_progress_bar=False)
        assert err.value.rank == 1 and "rank 1" in str(err.value)
        for rid in list(llm.engine.requests):
            llm.engine.abort_request(rid)
    finally:
        llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)


def test_ray_ranks_stop_with_the_engine(ray_cluster):
    if not ray.is_initialized():
        ray.init(address=ray_cluster.address)
    d = demo_model("llama", "tiny", 0)
    llm = LLM(d, tensor_parallel_size=2, distributed_executor_backend="ray", dtype="float32")
    [pid] = llm.engine.runner.ranks.pids
    out = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=4, temperature=0.0), use_progress_bar=False)
    assert len(out[0].outputs[0].token_ids) == 4
    llm.engine.shutdown()
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _alive(pid)
