"""Bounded queues: the least urgent class is refused first, queued work that has sent
nothing is shed for more urgent arrivals, and nothing is lost on the way."""

from __future__ import annotations

import asyncio

import pytest

from lockgate.engine import AsyncEngine, EngineOverloaded, SamplingParams
from lockgate.engine.admission import Admission, Queued
from lockgate.engine.llm import to_token_ids
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import assert_all_blocks_free, demo_model

CLASSES = ("priority", "online", "offline")


def q(rid, cls, tokens=10, tenant="t", sheddable=True):
    return Queued(rid, cls, CLASSES.index(cls), tenant, tokens, sheddable)


def test_offline_is_refused_first_and_sheds_for_online():
    """Room for 40 tokens, 4 requests of 10. Four offline queue; a fifth offline is refused
    (nothing less urgent to shed); an online arrival sheds the newest offline; a priority
    arrival sheds the next newest offline; once no offline work is queued, online is refused
    and priority sheds online."""
    adm = Admission(CLASSES, max_waiting_per_class=None, max_waiting_tokens=40)
    assert adm.count_bound is None
    for i in range(4):
        assert adm.admit(q(f"off{i}", "offline", tenant="batch")) == []
    with pytest.raises(EngineOverloaded) as exc:
        adm.admit(q("off4", "offline", tenant="batch"))
    assert exc.value.service_class == "offline" and not exc.value.shed and exc.value.retry_after >= 1
    def shed(arrival):
        victims = adm.admit(arrival)
        for v in victims:
            adm.count_shed(v)
        return [v.request_id for v in victims]

    assert shed(q("on0", "online")) == ["off3"]
    assert shed(q("vip0", "priority")) == ["off2"]
    assert shed(q("on1", "online")) == ["off1"]
    assert shed(q("vip1", "priority")) == ["off0"]
    # nothing less urgent than online is queued now: online is refused, priority sheds online
    with pytest.raises(EngineOverloaded):
        adm.admit(q("on2", "online"))
    assert shed(q("vip2", "priority")) == ["on1"]
    st = adm.stats()
    assert st.queued == {"priority": 3, "online": 1, "offline": 0}
    assert st.refused == {"priority": {}, "online": {"t": 1}, "offline": {"batch": 1}}
    assert st.shed == {"priority": {}, "online": {"t": 1}, "offline": {"batch": 4}}


def test_only_sheddable_work_is_shed_and_tokens_are_bounded_too():
    adm = Admission(CLASSES, max_waiting_per_class=None, max_waiting_tokens=1000)
    adm.admit(q("stream", "offline", tokens=600, sheddable=False))
    adm.admit(q("batch", "offline", tokens=300))
    # 900 queued: an online request of 200 needs 100 more: the sheddable one goes
    assert [v.request_id for v in adm.admit(q("on", "online", tokens=200))] == ["batch"]
    assert adm.tokens == 800
    # the stream is never shed: a second online request that does not fit is refused
    with pytest.raises(EngineOverloaded):
        adm.admit(q("on2", "online", tokens=300))
    adm.forget("stream")           # it sent its first output
    assert adm.admit(q("on2", "online", tokens=300)) == [] and adm.tokens == 500
    # into an empty queue even a request larger than the bound is taken
    for rid in ("on", "on2"):
        adm.forget(rid)
    assert adm.admit(q("huge", "offline", tokens=5000)) == [] and adm.tokens == 5000


def test_derived_token_bound_from_kv_and_cost_model():
    adm = Admission(CLASSES, max_waiting_per_class=None, max_waiting_tokens=None)
    adm.size(kv_tokens=10_000, tokens_per_s=None)
    assert adm.token_bound == 20_000
    adm.size(kv_tokens=10_000, tokens_per_s=5_000.0)
    assert adm.token_bound == 150_000           # 30 s of full steps
    adm.tokens = 50_000
    assert adm.retry_after() == 10.0
    adm.size(kv_tokens=10_000, tokens_per_s=1e10)  # a degenerate fit: the KV cache caps it
    assert adm.token_bound == 160_000


async def _drain(stream):
    last = None
    async for out in stream:
        last = out
    return last


def test_async_engine_sheds_queued_offline_for_online_and_loses_nothing():
    """One sequence slot, room for 4 queued requests (`max_waiting_tokens` four times one's
    prompt + max_tokens). An offline request runs; four more queue (two of them not
    sheddable); an online arrival sheds the newest sheddable offline one, whose stream raises
    EngineOverloaded(shed=True) before any output; a further offline arrival is refused.
    Everything else completes in full and the engine ends holding no block."""
    d = demo_model("llama")
    _, ids = to_token_ids(Tokenizer(d), "hello there")
    bound = 4 * (len(ids) + 40)

    async def main():
        async with AsyncEngine(d, dtype="float32", max_num_seqs=1, max_waiting_tokens=bound) as engine:
            params = SamplingParams(max_tokens=40, ignore_eos=True)
            first = engine.submit("hello there", params, "off-run", service_class="offline")
            it = first.__aiter__()
            await it.__anext__()                          # it runs and has sent output
            queued = [engine.submit("hello there", params, f"off{i}", service_class="offline",
                                    tenant="batch", sheddable=i < 2) for i in range(4)]
            # off0, off1 sheddable; off2, off3 streams that must not be shed
            online = engine.submit("hi", SamplingParams(max_tokens=5, ignore_eos=True), "on0",
                                   service_class="online", tenant="chat")
            with pytest.raises(EngineOverloaded) as exc:
                engine.submit("hello", params, "off-late", service_class="offline", tenant="batch")
            assert not exc.value.shed
            results = await asyncio.gather(*(_drain(s) for s in queued), return_exceptions=True)
            shed = [r for r in results if isinstance(r, EngineOverloaded)]
            assert len(shed) == 1 and shed[0].shed and isinstance(results[1], EngineOverloaded)
            assert [len(r.outputs[0].token_ids) for i, r in enumerate(results) if i != 1] == [40, 40, 40]
            assert len((await _drain(online)).outputs[0].token_ids) == 5
            assert len((await _drain(it)).outputs[0].token_ids) == 40
            ov = engine.stats().overload
            assert ov.shed["offline"] == {"batch": 1} and ov.refused["offline"] == {"batch": 1}
            assert ov.queued == {"priority": 0, "online": 0, "offline": 0} and ov.queued_tokens == 0
            return engine.core

    core = asyncio.run(main())
    assert_all_blocks_free(core)


def test_library_batch_of_offline_work_that_fits_is_queued_not_refused():
    """60 offline requests at once into an engine of 8 sequence slots: the queue holds
    prompt + max_tokens of each (a few hundred tokens, far inside the token bound the KV
    cache and the cost model size), so all 60 are queued and complete. Refusing background
    work is the gateway's decision (a flex 429), not the library's."""
    d = demo_model("llama")

    async def main():
        async with AsyncEngine(d, dtype="float32", max_num_seqs=8) as engine:
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            streams = [engine.submit(f"batch line {i}", params, f"b{i}", service_class="offline",
                                     tenant="batch") for i in range(60)]
            results = await asyncio.gather(*(_drain(s) for s in streams))
            assert [len(r.outputs[0].token_ids) for r in results] == [4] * 60
            ov = engine.stats().overload
            assert ov.refused["offline"] == {} and ov.queued_tokens == 0
            return engine.core

    core = asyncio.run(main())
    assert_all_blocks_free(core)
