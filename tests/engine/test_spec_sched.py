"""Drafts in the step (engine/spec/decode.py with engine/step_sizing.py): they never make a
step longer than its step-time target, and when the target or the token budget is tight the
less urgent class loses its drafts before the online class's."""

from __future__ import annotations

from lockgate.engine.cost_model import StepCostModel, StepShape
from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.decode import SpecDecoder
from tests.support.scheduler_harness import CLASSES, SchedulerHarness

K = 4
# a synthetic machine: 2 ms a step, 0.3 ms a decode row (a sequence and a sampled row), 0.05 ms
# a prompt token. A row with 4 drafts adds 4 prompt tokens and 4 sampled rows: about 0.65 ms.
CONST_S, SEQ_S, TOKEN_S, SAMPLE_S = 2e-3, 2e-4, 5e-5, 1e-4


def fitted() -> StepCostModel:
    cost = StepCostModel()
    for i in range(60):
        shape = StepShape()
        for j in range(1 + i % 23):
            shape.add_decode(40 + 7 * j)
        if i % 3:
            shape.add_prefill(1 + 13 * i % 300, 5 * i % 200, i % 2 == 0)
        cost.observe(shape, CONST_S + SEQ_S * shape.num_seqs + TOKEN_S * shape.prefill_tokens
                     + SAMPLE_S * shape.sampled)
    assert cost.ready
    return cost


def decoding(tmp_path, *, online: int, offline: int, cost: StepCostModel, **kwargs) -> SchedulerHarness:
    """A harness whose `online` + `offline` requests are all past their prompts, with a
    decoder that always proposes K tokens and no automatic switch (only the hold decides)."""
    eng = SchedulerHarness(tmp_path, num_blocks=1024, block_size=16, **kwargs)
    for i in range(online + offline):
        eng.add(20, 64, cls="online" if i < online else "offline", tenant=f"t{i}")
    for _ in range(30):
        if all(s.is_decode for s in eng.sched.running) and not eng.sched.waiting:
            break
        eng.step()
    assert len(eng.sched.running) == online + offline and all(s.is_decode for s in eng.sched.running)
    eng.sched.cost = cost
    spec = SpecDecoder(SpeculativeConfig(num_speculative_tokens=K, auto_disable=False), eng.kv, CLASSES,
                       [10_000] * len(CLASSES))
    spec.proposer = lambda seq, k: [7] * k
    eng.sched.spec = spec
    return eng


def drafts_by_class(out) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {"online": [], "offline": []}
    for seq, n in out.scheduled:
        got[seq.state.req.service_class].append(n - 1)
    return got


def test_drafts_are_held_to_the_step_target_and_the_less_urgent_class_loses_them_first(tmp_path):
    """1 online + 4 offline decodes: the plain step is 2 + 5 x 0.3 = 3.5 ms, its target the
    online part plus a chunk of 512 / 16 tokens, about 4.2 ms: room for about one row's four
    drafts. The online row gets all K, the offline rows what is left (none), and the step is
    predicted within its target. With the offline rows alone in sight, their step's room (a
    chunk of 32 tokens) goes to them."""
    cost = fitted()
    eng = decoding(tmp_path, online=1, offline=4, cost=cost, max_num_batched_tokens=512)
    out = eng.sched.schedule()
    eng.check(out)
    got = drafts_by_class(out)
    assert got["online"] == [K]
    assert sum(got["offline"]) < K
    assert out.step_target_s is not None and cost.predict(out.shape) <= out.step_target_s * 1.0001
    plain = StepShape()
    for seq, _ in out.scheduled:
        plain.add_decode(seq.num_tokens)
    assert cost.predict(plain) < out.step_target_s
    alone = decoding(tmp_path, online=0, offline=4, cost=cost, max_num_batched_tokens=512)
    out = alone.sched.schedule()
    alone.check(out)
    assert sum(drafts_by_class(out)["offline"]) >= 2 * K
    assert cost.predict(out.shape) <= out.step_target_s * 1.0001


def test_a_tight_token_budget_cuts_the_less_urgent_drafts_first(tmp_path):
    """No fitted cost model (no time hold): a budget of 12 tokens for 1 online + 4 offline
    decodes keeps a token for every decode; the online row takes its K drafts, the offline
    rows share the 3 tokens left."""
    eng = decoding(tmp_path, online=1, offline=4, cost=StepCostModel(), max_num_batched_tokens=12)
    out = eng.sched.schedule()
    eng.check(out)
    got = drafts_by_class(out)
    assert got["online"] == [K]
    assert sum(got["offline"]) == 12 - 5 - K and len(got["offline"]) == 4
    assert out.num_batched_tokens == 12
