"""ProcessEngine: the engine in a child process gives the in-process engine's outputs, its
refusals through `accepted()`, adapters by RPC; a killed child, a failed start and a shutdown
leave no stream waiting and no process behind."""

from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from lockgate.engine import (
    AsyncEngine,
    EngineDead,
    InvalidRequest,
    LoRARequest,
    ProcessEngine,
    PromptTooLong,
    SamplingParams,
    UnknownModel,
)
from lockgate.engine.lora_demo import write_demo_adapter
from tests.support.helpers import demo_model, random_prompts

KW = {"max_model_len": 256, "kv_cache_memory": 16 << 20, "num_threads": 1, "enable_lora": True}


@pytest.fixture(scope="module")
def model() -> str:
    return demo_model("llama")


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> LoRARequest:
    path = write_demo_adapter(model, tmp_path_factory.mktemp("adapters") / "a1", rank=4, targets="q,v", seed=3)
    return LoRARequest("a1", 1, str(path))


@pytest.fixture(scope="module")
def engines(model, one_torch_thread):
    """One child engine and one in-process engine (the oracle) for the module; streams bind
    to the event loop they are opened in, so each test runs its own."""
    child, local = ProcessEngine(model, **KW), AsyncEngine(model, **KW)

    async def start():
        await asyncio.gather(child.start(), local.start())

    asyncio.run(start())
    yield child, local

    async def stop():
        await asyncio.gather(child.shutdown(), local.shutdown())

    asyncio.run(stop())


async def run(engine, prompt, params, rid, *, stream=True, **kw):
    s = engine.submit({"prompt_token_ids": prompt}, params, rid, **kw)
    await s.accepted()
    outs = [o async for o in s.outputs()]
    final = outs[-1]
    assert final.finished and (len(outs) > 1) == stream
    assert all(o.prompt_token_ids == prompt for o in outs)    # each output has its prompt
    return [c.token_ids for c in final.outputs]


def test_streams_and_non_streams_equal_the_in_process_engine(engines, model):
    child, local = engines
    prompts = random_prompts(model, [5, 17, 40, 33], seed=7)
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    sampled = SamplingParams(max_tokens=10, temperature=1.0, seed=5, n=2)

    async def both(engine, tag):
        jobs = [run(engine, p, greedy, f"{tag}-g{i}") for i, p in enumerate(prompts)]
        jobs.append(run(engine, prompts[0], sampled, f"{tag}-n2"))
        jobs.append(run(engine, prompts[1], SamplingParams(max_tokens=1), f"{tag}-one", stream=False))
        return await asyncio.gather(*jobs)

    got = asyncio.run(both(child, "p"))
    assert got == asyncio.run(both(local, "l"))
    assert len(got[4]) == 2 and all(len(ids) == 10 for ids in got[4])
    assert child.is_ready and child.stats().kv.total > 0


def test_refusals_surface_through_accepted_with_their_field(engines, model):
    child, _ = engines
    (prompt,) = random_prompts(model, [300], seed=1)

    async def main():
        too_long = child.submit({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), "long")
        with pytest.raises(PromptTooLong) as exc:
            await too_long.accepted()
        assert exc.value.field == "prompt"
        unknown = child.submit({"prompt_token_ids": prompt[:4]}, SamplingParams(max_tokens=4), "u", model="nope")
        with pytest.raises(UnknownModel) as exc2:
            async for _ in unknown:     # iterating without accepted() raises it too
                pass
        assert exc2.value.field == "model"
        held = child.submit({"prompt_token_ids": prompt[:4]}, SamplingParams(max_tokens=50), "dup")
        with pytest.raises(InvalidRequest) as exc3:
            child.submit({"prompt_token_ids": prompt[:4]}, SamplingParams(max_tokens=4), "dup")
        assert exc3.value.field == "request_id"
        held.close()

    asyncio.run(main())


def test_abort_ends_the_request_and_frees_its_blocks(engines, model):
    child, _ = engines
    (prompt,) = random_prompts(model, [40], seed=2)

    async def main():
        s = child.submit({"prompt_token_ids": prompt}, SamplingParams(max_tokens=200, ignore_eos=True), "ab")
        await s.accepted()
        first = await s.__anext__()
        assert not first.finished
        s.close()
        deadline = time.monotonic() + 10
        while child.stats().kv.used and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert child.stats().kv.used == 0 and not any(child.stats().running.values())

    asyncio.run(main())


def test_an_adapter_added_is_used_and_removed(engines, model, adapter):
    child, local = engines
    (prompt,) = random_prompts(model, [20], seed=4)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)

    async def main(engine, tag):
        await engine.add_lora(adapter)
        assert set(engine.loras) == {"a1"}
        tuned = await run(engine, prompt, greedy, f"{tag}-a", model="a1")
        base = await run(engine, prompt, greedy, f"{tag}-b")
        assert engine.remove_lora("a1") and not engine.loras
        return tuned, base

    tuned, base = asyncio.run(main(child, "p"))
    assert tuned != base
    assert (tuned, base) == asyncio.run(main(local, "l"))


def _child_pid(engine: ProcessEngine) -> int:
    assert engine.process is not None and engine.process.pid is not None
    return engine.process.pid


def test_a_killed_child_fails_open_streams_and_later_submits(model, one_torch_thread):
    (prompt,) = random_prompts(model, [10], seed=5)

    async def main():
        engine = ProcessEngine(model, **KW)
        await engine.start()
        s = engine.submit({"prompt_token_ids": prompt}, SamplingParams(max_tokens=240, ignore_eos=True), "k")
        await s.accepted()
        await s.__anext__()
        os.kill(_child_pid(engine), signal.SIGKILL)
        with pytest.raises(EngineDead):
            async with asyncio.timeout(10):
                async for _ in s:
                    pass
        assert not engine.is_ready
        with pytest.raises(EngineDead):
            engine.submit({"prompt_token_ids": prompt}, SamplingParams(max_tokens=4), "k2")
        with pytest.raises(EngineDead):
            await engine.add_lora(LoRARequest("x", 9, "/nowhere"))
        proc = engine.process
        await engine.shutdown()
        assert proc is not None and not proc.is_alive()

    asyncio.run(main())


def test_shutdown_stops_the_child_and_fails_open_streams(model, one_torch_thread):
    (prompt,) = random_prompts(model, [10], seed=6)

    async def main():
        engine = ProcessEngine(model, stop_timeout_s=5.0, **KW)
        await engine.start()
        proc = engine.process
        s = engine.submit({"prompt_token_ids": prompt}, SamplingParams(max_tokens=240, ignore_eos=True), "s")
        await s.accepted()
        t0 = time.monotonic()
        await engine.shutdown()
        assert time.monotonic() - t0 < 6
        assert proc is not None and not proc.is_alive() and proc.exitcode == 0
        with pytest.raises(EngineDead):
            async with asyncio.timeout(5):
                async for _ in s:
                    pass
        assert not engine.is_ready

    asyncio.run(main())


def test_a_failed_start_raises_its_error_and_leaves_no_process(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    import multiprocessing

    before = set(multiprocessing.active_children())

    async def main():
        engine = ProcessEngine(str(tmp_path), **KW)
        with pytest.raises(Exception) as exc:
            await engine.start()
        return exc.value, engine

    exc, engine = asyncio.run(main())
    assert "config.json" in str(exc) or "JSON" in type(exc).__name__ + str(exc)
    assert set(multiprocessing.active_children()) <= before
    assert engine.process is None and not engine.is_ready


def test_the_servers_cpu_counts_as_the_engine_process_own():
    from lockgate.engine import threads

    t = os.times()
    assert abs(threads.pid_cpu_s(os.getpid()) - (t.user + t.system)) < 0.1
    assert threads.pid_cpu_s(2**22 + 12345) == 0.0          # no such process: nothing counted
    alone = threads.own_cpu_s()
    threads.partner_pids.add(os.getpid())       # this process as its own partner: counted twice
    try:
        assert threads.own_cpu_s() >= 2 * alone - 0.1
    finally:
        threads.partner_pids.discard(os.getpid())


def test_a_purged_tenants_prefix_is_computed_again(engines, model):
    child, local = engines
    if not hasattr(local, "purge_tenant"):
        pytest.skip("this engine has no tenant purge")
    (prompt,) = random_prompts(model, [40], seed=8)
    params = SamplingParams(max_tokens=2)

    async def cached(rid: str) -> int:
        s = child.submit({"prompt_token_ids": prompt}, params, rid, tenant="gone")
        outs = [o async for o in s.outputs()]
        return outs[-1].num_cached_tokens

    async def main():
        await cached("purge-1")
        assert await cached("purge-2") > 0        # the tenant's prefix is cached...
        child.purge_tenant("gone")
        assert await cached("purge-3") == 0       # ...and gone once purged

    asyncio.run(main())
