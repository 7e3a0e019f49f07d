"""The step-cost model, step sizing from it, and the priority class above online."""

from __future__ import annotations

import itertools
import random

import pytest

import lockgate.engine.scheduler as scheduler_mod
from lockgate.engine.config import EngineConfig
from lockgate.engine.cost_model import MIN_SAMPLES, StepCostModel, StepShape
from lockgate.engine.engine_core import EngineCore
from lockgate.engine.request import EngineRequest
from lockgate.engine.sampling_params import SamplingParams
from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, random_prompts
from tests.support.scheduler_harness import SchedulerHarness

# a synthetic machine: seconds per step as a function of what it does
TRUE = {"const": 2e-3, "prefill_tokens": 5e-5, "seqs": 2e-4, "decode_kv_tokens": 1e-7,
        "prefill_attention": 2e-9, "sampled": 1e-4}


def true_time(shape: StepShape) -> float:
    return (TRUE["const"] + TRUE["prefill_tokens"] * shape.prefill_tokens + TRUE["seqs"] * shape.num_seqs
            + TRUE["decode_kv_tokens"] * shape.decode_kv_tokens
            + TRUE["prefill_attention"] * shape.prefill_attention + TRUE["sampled"] * shape.sampled)


def random_shape(rng: random.Random) -> StepShape:
    shape = StepShape()
    for _ in range(rng.randint(0, 40)):
        shape.add_decode(rng.randint(16, 2048))
    for _ in range(rng.randint(0, 3)):
        shape.add_prefill(rng.randint(1, 512), rng.randint(0, 1024), rng.random() < 0.5)
    if shape.num_seqs == 0:
        shape.add_decode(32)
    return shape


def trained(noise: float = 0.02, steps: int = 400, seed: int = 0) -> StepCostModel:
    rng = random.Random(seed)  # noqa: S311 - a seeded test workload, not a secret
    model = StepCostModel()
    for _ in range(steps):
        shape = random_shape(rng)
        model.observe(shape, true_time(shape) * (1 + rng.uniform(-noise, noise)), model.predict(shape))
    return model


def test_cost_model_converges_on_a_synthetic_step_time():
    """400 steps of random shapes from a known linear step time with +-2% noise: the
    coefficients near the truth, recent predictions within 3% (median), and held-out shapes
    predicted within 5%."""
    model = trained()
    assert model.ready
    coef = model.coefficients()
    # sequences and sampled rows move together in most steps (every decode is both), so
    # those two may trade between them; the rest are pinned down
    for name, value in TRUE.items():
        assert coef[name] == pytest.approx(value, rel=0.10 if name not in ("seqs", "sampled") else 0.3), name
    assert model.prediction_error() < 0.03
    rng = random.Random(1)  # noqa: S311 - a seeded test workload, not a secret
    for _ in range(50):
        shape = random_shape(rng)
        assert model.predict(shape) == pytest.approx(true_time(shape), rel=0.05)


def test_cost_model_keeps_every_coefficient_non_negative_the_constant_too():
    """Step times that an unconstrained fit would explain with a negative constant (here
    5 us per prefill token less 2 ms, over prompts of 500-1000 tokens): the constant is held
    at zero (the prompt-size terms carry the step), so no part of a step is ever a saving."""
    model = StepCostModel()
    for i in range(200):
        shape = StepShape()
        shape.add_prefill(500 + (i * 37) % 500, 0, True)
        model.observe(shape, 5e-6 * shape.prefill_tokens - 2e-3)
    coef = model.coefficients()
    assert coef is not None and all(v >= 0 for v in coef.values()), coef
    assert coef["const"] == 0
    assert model.predict(shape) > 0


def test_cost_model_predicts_nothing_until_it_has_seen_enough_and_follows_a_change():
    model = StepCostModel()
    shape = StepShape()
    shape.add_decode(100)
    for i in range(MIN_SAMPLES - 1):
        assert model.predict(shape) is None
        model.observe(shape, 0.01 + 1e-4 * (i % 3))
    model = trained(steps=300)
    # the machine gets twice as slow: old steps fade, the fit follows
    rng = random.Random(5)  # noqa: S311 - a seeded test workload, not a secret
    for _ in range(800):
        s = random_shape(rng)
        model.observe(s, 2 * true_time(s), model.predict(s))
    s = random_shape(rng)
    assert model.predict(s) == pytest.approx(2 * true_time(s), rel=0.1)


def test_prefill_room_is_the_inverse_of_predict():
    model = trained()
    base = StepShape()
    for _ in range(10):
        base.add_decode(500)
    t0 = model.predict(base)
    for budget_s, computed in [(0.005, 0), (0.02, 300), (0.1, 1000)]:
        n = model.prefill_room(budget_s, computed)
        grown = StepShape(**{f: getattr(base, f) for f in base.__slots__})
        grown.add_prefill(n, computed, True)
        more = StepShape(**{f: getattr(base, f) for f in base.__slots__})
        more.add_prefill(n + 2, computed, True)
        assert model.predict(grown) - t0 <= budget_s * 1.0001
        assert model.predict(more) - t0 > budget_s
    assert model.prefill_room(0.0, 0) == 0


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def prefill_tokens(out, cls):
    return sum(n for s, n in out.scheduled if s.state.req.service_class == cls and n > 1)


def test_sizing_caps_offline_prefill_while_online_is_in_sight(tmp_path, monkeypatch):
    """A trained cost model (the synthetic machine above), budget 512 tokens, window 5 s.
    Offline alone: steps take the whole budget. An online request arrives: its first step
    has no offline prefill at all; while it decodes, offline prefill only fills the step up
    to its target (the predicted time of the step's decodes, or the online part plus a chunk
    of 512 / 16 tokens, whichever is more). After it finished, the cap stays for the
    window and is lifted once the window has passed with no online arrival."""
    clock = Clock()
    monkeypatch.setattr(scheduler_mod.time, "monotonic", clock)
    eng = SchedulerHarness(tmp_path, num_blocks=2048, block_size=16, max_num_batched_tokens=512,
                           urgent_window_s=5.0)
    eng.sched.cost = cost = trained()
    for _ in range(6):
        eng.add(1500, 64, cls="offline", tenant="batch")
    out = eng.step()
    assert prefill_tokens(out, "offline") == 512 and out.step_target_s is None
    eng.add(40, 20, cls="online", tenant="chat")
    out = eng.step()
    assert prefill_tokens(out, "online") == 40 and prefill_tokens(out, "offline") == 0
    capped = 0
    for _ in range(19):     # the online request decodes
        out = eng.step()
        assert out.urgent_class == eng.sched.classes.index("online")
        off = prefill_tokens(out, "offline")
        assert off < 512
        if off > 16:        # a block always moves; beyond it, the target holds
            assert cost.predict(out.shape) <= out.step_target_s * 1.001
            capped += 1
    assert capped >= 10
    assert not any(s.state.req.service_class == "online" for s in eng.sched.running + eng.sched.waiting)
    online = eng.sched.classes.index("online")
    clock.t += 4.0          # inside the window: still sized
    out = eng.step()
    assert out.urgent_class == online and out.step_target_s is not None
    assert prefill_tokens(out, "offline") < 512
    clock.t += 2.0          # 6 s since the online arrival: lifted
    out = eng.step()
    assert out.urgent_class == eng.sched.classes.index("offline") and out.step_target_s is None
    assert prefill_tokens(out, "offline") == 512


def test_offline_decodes_and_prefill_take_turns_when_the_decodes_fill_the_target(tmp_path, monkeypatch):
    """40 offline sequences decoding, more offline prompts waiting, an online request in
    sight: the decodes alone make the step as long as the target, so no offline chunk fits
    beside them. Steps then alternate: a background prefill step (no offline decodes, offline
    prefill up to the same target) and a decode step (every decode). No step is predicted
    longer than its target (bar the block that always moves), offline decodes never sit out
    two steps in a row, and offline prefill keeps moving."""
    clock = Clock()
    monkeypatch.setattr(scheduler_mod.time, "monotonic", clock)
    eng = SchedulerHarness(tmp_path, num_blocks=4096, block_size=16, max_num_batched_tokens=512)
    eng.sched.cost = cost = trained()
    for _ in range(40):
        eng.add(64, 400, cls="offline", tenant="batch")
    for _ in range(8):      # prompts in, everyone decoding, before any online arrival
        eng.step()
    assert all(s.is_decode for s in eng.sched.running) and len(eng.sched.running) == 40
    for _ in range(4):
        eng.add(1500, 8, cls="offline", tenant="batch")
    eng.add(40, 30, cls="online", tenant="chat")
    out = eng.step()        # the arrival's own step: the online prompt alone
    assert prefill_tokens(out, "online") == 40 and prefill_tokens(out, "offline") == 0
    kinds = []
    for _ in range(20):
        out = eng.step()
        off_decodes = sum(1 for s, n in out.scheduled if s.state.req.service_class == "offline" and n == 1)
        off_prefill = prefill_tokens(out, "offline")
        on_decodes = sum(1 for s, n in out.scheduled if s.state.req.service_class == "online")
        assert on_decodes == 1                       # the online stream moves every step
        assert out.step_target_s is not None
        if off_prefill > 16:
            assert cost.predict(out.shape) <= out.step_target_s * 1.001
        kinds.append("decode" if off_decodes else "prefill")
        if not off_decodes:
            assert off_prefill > 16                  # a background prefill step does prefill
    assert "prefill" in kinds and "decode" in kinds
    assert all(not (a == b == "prefill") for a, b in itertools.pairwise(kinds))
    assert kinds.count("prefill") >= 6


def test_a_background_prefill_step_that_can_start_nothing_runs_the_decodes(tmp_path, monkeypatch):
    """As above, but every sequence slot is taken: the waiting offline prompts cannot start,
    so a step planned as background prefill runs the offline decodes after all (no empty
    step, no stall)."""
    monkeypatch.setattr(scheduler_mod.time, "monotonic", Clock())
    eng = SchedulerHarness(tmp_path, num_blocks=4096, block_size=16, max_num_batched_tokens=512,
                           max_num_seqs=41)
    eng.sched.cost = trained()
    for _ in range(40):
        eng.add(64, 400, cls="offline", tenant="batch")
    for _ in range(8):
        eng.step()
    eng.add(40, 30, cls="online", tenant="chat")
    eng.step()
    eng.add(1500, 8, cls="offline", tenant="batch")       # waits: no slot for it
    sizer = eng.sched.sizer
    cancelled = []
    cancel = sizer.cancel_background_prefill_step
    monkeypatch.setattr(sizer, "cancel_background_prefill_step", lambda: (cancelled.append(1), cancel()))
    for _ in range(10):
        out = eng.step()
        assert sum(1 for s, n in out.scheduled if s.state.req.service_class == "offline" and n == 1) == 40
    assert len(eng.sched.waiting) == 1 and len(cancelled) >= 5


def test_explicit_slo_and_prefill_budget_override_the_default(tmp_path, monkeypatch):
    """`slo={"online": {"tpot_ms": 40}}`: offline prefill fills steps to 40 ms predicted;
    an explicit prefill_token_budget caps a class by tokens instead."""
    monkeypatch.setattr(scheduler_mod.time, "monotonic", Clock())
    eng = SchedulerHarness(tmp_path, num_blocks=2048, block_size=16, max_num_batched_tokens=2048,
                           slo={"online": {"tpot_ms": 40}})
    eng.sched.cost = cost = trained()
    eng.add(8, 30, cls="online")
    eng.step()
    for _ in range(3):
        eng.add(1500, 8, cls="offline")
    out = eng.step()
    assert out.step_target_s == pytest.approx(0.040)
    assert 0.035 < cost.predict(out.shape) <= 0.040
    # the engine's stats (the console's live page) show each class's target and the step's
    summary = eng.sched.sizer.cost_summary("cpu")
    assert summary.step_targets["online"] == pytest.approx(0.040) and summary.step_targets["offline"] is None
    assert summary.last_urgent_class == "online" and summary.last_step_target_s == pytest.approx(0.040)
    eng2 = SchedulerHarness(tmp_path, num_blocks=2048, block_size=16, max_num_batched_tokens=2048,
                            prefill_token_budget={"offline": 100})
    eng2.sched.cost = trained()
    eng2.add(8, 30, cls="online")
    eng2.step()
    eng2.add(1500, 8, cls="offline")
    assert prefill_tokens(eng2.step(), "offline") == 100


def test_fcfs_is_not_sized(tmp_path):
    eng = SchedulerHarness(tmp_path, num_blocks=2048, block_size=16, max_num_batched_tokens=512,
                           scheduling_policy="fcfs")
    eng.sched.cost = trained()
    eng.add(8, 30, cls="online")
    eng.step()
    eng.add(1500, 8, cls="offline")
    assert prefill_tokens(eng.step(), "offline") == 512 - 1     # the budget less the decode


def test_priority_preempts_online_when_sequence_slots_run_out(tmp_path):
    """max_num_seqs 2, both slots held by online requests: a priority arrival preempts the
    less urgent (later) one and runs at once, alone in its prompt step; the preempted request
    keeps its place in line (ahead of a later online arrival) and finishes."""
    eng = SchedulerHarness(tmp_path, num_blocks=256, max_num_seqs=2, max_num_batched_tokens=64)
    a = eng.add(8, 20, cls="online", tenant="t")
    b = eng.add(8, 20, cls="online", tenant="t")
    eng.step()
    eng.step()
    p = eng.add(8, 5, cls="priority", tenant="vip")
    late = eng.add(8, 5, cls="online", tenant="t")
    out = eng.step()
    assert [s.state for s in out.preempted] == [b]
    assert list(dict(out.scheduled)) == [p.seqs[0]]     # its prompt step: nothing less urgent
    assert a.seqs[0] in dict(eng.step().scheduled)      # then a decodes beside it
    # once the priority request is done, b (waiting longer) goes before the later arrival
    order = []
    while eng.sched.has_work:
        out = eng.step()
        for s, _ in out.scheduled:
            if s.state not in order and s.state in (b, late):
                order.append(s.state)
    assert order[0] is b
    assert all(st.seqs[0].num_output_tokens == st.req.sampling.max_tokens for st in (a, b, p, late))
    assert eng.kv.num_used_blocks == 0


def test_preempted_online_requests_match_hf(monkeypatch):
    """The real engine, max_num_seqs 2 filled by two online requests; a priority request
    arrives mid-decode and preempts one: every output (the preempted one recomputed) equals
    HF greedy."""
    monkeypatch.setenv("LOCKGATE_CHECK_INVARIANTS", "1")
    d = demo_model("llama")
    core = EngineCore(EngineConfig(model=d, dtype="float32", max_num_seqs=2, num_kv_blocks=64))
    prompts = random_prompts(d, [20, 24, 12], seed=3)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    states = [core.add_request(EngineRequest(f"on{i}", p, sp, service_class="online"))
              for i, p in enumerate(prompts[:2])]
    for _ in range(4):
        core.step()
    states.append(core.add_request(EngineRequest("vip", prompts[2], sp, service_class="priority")))
    outs = {}
    while core.has_unfinished:
        for o in core.step():
            if o.finished:
                outs[o.request_id] = o
    assert sum(o.metrics.num_preemptions for o in outs.values()) >= 1
    for rid, prompt in zip(("on0", "on1", "vip"), prompts, strict=True):
        assert outs[rid].outputs[0].token_ids == hf_greedy(d, prompt, 16, ignore_eos=True), rid
    assert_all_blocks_free(core)


def test_engine_reports_its_cost_model():
    d = demo_model("llama")
    core = EngineCore(EngineConfig(model=d, dtype="float32"))
    prompts = random_prompts(d, [8, 40, 100, 16] * 10, seed=4)
    sp = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        core.add_request(EngineRequest(f"r{i}", p, sp))
        core.step()
    while core.has_unfinished:
        core.step()
    cm = core.stats().cost_model
    assert cm.ready and cm.samples >= MIN_SAMPLES and cm.predictions > 0
    assert set(cm.coefficients) == set(TRUE) and all(v >= 0 for v in cm.coefficients.values())
    assert 0 <= cm.prediction_error_median < 10


def test_an_arrivals_first_step_runs_no_less_urgent_work(tmp_path, monkeypatch):
    """Four offline requests decoding; an online arrival's prompt step holds only online
    work (no offline decode, no offline prefill); the step after it, offline decodes again.
    Outside sizing (fcfs) the offline decodes share the arrival's step."""
    monkeypatch.setattr(scheduler_mod.time, "monotonic", Clock())
    for policy in ("priority", "fcfs"):
        eng = SchedulerHarness(tmp_path, num_blocks=512, block_size=16, max_num_batched_tokens=512,
                               scheduling_policy=policy)
        eng.sched.cost = trained()
        for _ in range(4):
            eng.add(20, 50, cls="offline", tenant="batch")
        eng.step()
        assert sum(1 for s, n in eng.step().scheduled if s.state.req.service_class == "offline") == 4
        eng.add(40, 5, cls="online", tenant="chat")
        first = {s.state.req.service_class for s, _ in eng.step().scheduled}
        after = [s.state.req.service_class for s, _ in eng.step().scheduled]
        if policy == "priority":
            assert first == {"online"}
            assert after.count("offline") == 4 and after.count("online") == 1
        else:
            assert first == {"online", "offline"}


def test_a_stream_of_urgent_prompts_does_not_stop_less_urgent_decodes(tmp_path, monkeypatch):
    """An online prompt arriving before every step: offline decodes still run every other
    step (an arrival's step runs nothing less urgent, but never two in a row)."""
    monkeypatch.setattr(scheduler_mod.time, "monotonic", Clock())
    eng = SchedulerHarness(tmp_path, num_blocks=1024, block_size=16, max_num_batched_tokens=512)
    eng.sched.cost = trained()
    off = eng.add(20, 40, cls="offline", tenant="batch")
    eng.step()
    ran = []
    for _ in range(20):
        eng.add(30, 2, cls="online", tenant="chat")
        ran.append(off.seqs[0] in dict(eng.step().scheduled))
    assert ran.count(True) == 10 and all(a != b for a, b in itertools.pairwise(ran))
