"""A tensor-parallel rank that dies: AsyncEngine fails the requests in flight (EngineDead),
rebuilds its rank group and serves again, the same greedy output as before; where the group
cannot be rebuilt, the engine stops and says so to every later caller. Collective time and
each rank's memory are in its stats."""

from __future__ import annotations

import asyncio
import os
import signal

from lockgate.engine import AsyncEngine, EngineDead, SamplingParams
from lockgate.engine.parallel.worker import FAULT_ENV
from tests.support.helpers import assert_all_blocks_free, demo_model

KW = {"num_kv_blocks": 64, "dtype": "float32", "num_threads": 1, "rank_start_timeout_s": 60}


async def _run(engine: AsyncEngine, rid: str, max_tokens: int) -> list[int] | Exception:
    final = None
    try:
        async for out in engine.generate({"prompt_token_ids": [5, 6, 7, 8, 9]},
                                         SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True), rid):
            final = out
    except EngineDead as exc:
        return exc
    return list(final.outputs[0].token_ids)


def test_a_killed_rank_fails_its_requests_and_the_group_is_rebuilt(monkeypatch):
    async def main():
        async with AsyncEngine(demo_model("llama"), tensor_parallel_size=2, **KW) as engine:
            want = await _run(engine, "before", 8)
            stats = engine.stats().parallel
            assert stats is not None and stats.tensor_parallel_size == 2 and stats.num_collectives > 0
            assert [r.rank for r in stats.ranks] == [0, 1] and all(r.weights_bytes > 0 for r in stats.ranks)
            assert stats.ranks[1].pid == engine.core.runner.ranks.pids[0]
            assert all(r.kv_cache_bytes > 0 for r in stats.ranks) and 0 < stats.collective_s < stats.forward_s
            tasks = [asyncio.create_task(_run(engine, f"r{i}", 400)) for i in range(4)]
            while engine.stats().num_generated_tokens < 20:
                await asyncio.sleep(0.01)
            os.kill(engine.core.runner.ranks.pids[0], signal.SIGKILL)
            failed = await asyncio.wait_for(asyncio.gather(*tasks), 120)
            assert all(isinstance(f, EngineDead) and "rank 1" in str(f) for f in failed), failed
            assert await asyncio.wait_for(_run(engine, "after", 8), 120) == want
            stats = engine.stats().parallel
            assert stats.rank_failures == 1 and stats.last_recovery_s is not None
            assert engine.stats().num_requests == 0
            assert_all_blocks_free(engine.core)
            # the next rank cannot start: the engine stops, and says so
            monkeypatch.setenv(FAULT_ENV, "start:1")
            task = asyncio.create_task(_run(engine, "doomed", 400))
            await asyncio.sleep(0.2)
            os.kill(engine.core.runner.ranks.pids[0], signal.SIGKILL)
            assert isinstance(await asyncio.wait_for(task, 120), EngineDead)
            for _ in range(600):
                if engine._error is not None:
                    break
                await asyncio.sleep(0.1)
            later = await _run(engine, "later", 2)
            assert isinstance(later, EngineDead) and "rank 1 failed while starting" in str(later), later
            return engine.core.runner.ranks

    ranks = asyncio.run(main())
    assert all(p.poll() is not None for p in ranks.procs)
