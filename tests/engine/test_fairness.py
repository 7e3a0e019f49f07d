"""Tenant fairness, priority preemption, reserved KV and tenant-salted prefix caching, with
a fake model runner (tests/support/scheduler_harness.py's SchedulerHarness: every sampled
token is 7). Each test is a worked example; the docstring does the arithmetic. Service
(VTC): uncached prompt tokens x 1 + output tokens x 2, divided by the tenant's weight."""

from __future__ import annotations

import random

import pytest

from lockgate.engine.request import SeqStatus
from lockgate.engine.scheduler import DECODE_COST, PREFILL_COST
from tests.support.scheduler_harness import CLASSES, SchedulerHarness, names

ONLINE = CLASSES.index("online")


def counter(eng, tenant, cls="online"):
    return eng.sched.fair.counter(CLASSES.index(cls), tenant)


def test_class_order_before_arrival(tmp_path):
    """Budget 8. An offline request (8 tokens) arrives first, an online one (8 tokens)
    second: the online one gets the whole budget of the first step."""
    eng = SchedulerHarness(tmp_path, num_blocks=32, max_num_batched_tokens=8)
    eng.add(8, 2, cls="offline", tenant="a")
    eng.add(8, 2, cls="online", tenant="b")
    assert names(eng.step()) == [("r1", 8)]
    eng.run()


def test_tenant_with_least_service_goes_next(tmp_path):
    """Budget 10, one class. a has r0 (10 tokens, 3 outputs) and b has r1 (1 token, 3
    outputs). Step 1: counters tie at 0, so by name a first: r0 takes 10... no: the budget
    is 11, r0 takes 10 and r1 1; a = 10, b = 1. Then a sends r2 and b sends r3 (10 tokens
    each), a first. Step 2 (budget 10): the decodes first, least service first (r1 then
    r0): b = 3, a = 12; the 8 tokens left go to b's r3 although a's r2 arrived earlier."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=11)
    eng.add(10, 3, tenant="a")
    eng.add(1, 3, tenant="b")
    assert names(eng.step()) == [("r0", 10), ("r1", 1)]
    assert counter(eng, "a") == 10 * PREFILL_COST and counter(eng, "b") == 1 * PREFILL_COST
    eng.add(10, 3, tenant="a")
    eng.add(10, 3, tenant="b")
    eng.sched.max_num_batched_tokens = 10
    assert names(eng.step()) == [("r1", 1), ("r0", 1), ("r3", 8)]
    assert counter(eng, "a") == 10 + DECODE_COST and counter(eng, "b") == 1 + DECODE_COST + 8
    eng.run()


def test_weights_scale_service(tmp_path):
    """Weight 2 halves the counter: a (weight 1) and b (weight 2) each compute 10 prompt
    tokens: a = 10, b = 5. Step 2, budget 10: decodes (b's first: 5 < 10) cost a 2 and b
    2 / 2 = 1; b (6) < a (12), so the 8 tokens left go to b's new request."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=20)
    eng.add(10, 5, tenant="a")
    eng.add(10, 5, tenant="b", weight=2.0)
    eng.step()
    assert counter(eng, "a") == 10 and counter(eng, "b") == 5
    eng.add(10, 1, tenant="a")
    eng.add(10, 1, tenant="b", weight=2.0)
    eng.sched.max_num_batched_tokens = 10
    assert names(eng.step()) == [("r1", 1), ("r0", 1), ("r3", 8)]
    assert counter(eng, "a") == 12 and counter(eng, "b") == 5 + 1 + 4
    eng.run()


def test_priority_orders_within_a_tenant_not_across(tmp_path):
    """a runs r0 (8 tokens), b runs r1 (1 token): a = 8, b = 1. Then a sends r2
    (priority 0), b sends r3 (priority 0), a sends r4 (priority -5, more urgent). Budget 6.
    Step 2: decodes r1, r0 (b = 3, a = 10); 4 tokens left go to b (3 < 10): r3, although
    a's r4 is more urgent by priority: priority orders within a tenant, not across.
    Step 3: decodes r1, r3, r0 (b = 3 + 4 + 4 = 11, a = 12); b has nothing waiting, so
    the 3 tokens left go to a, and to its urgent r4 before its earlier r2."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=9)
    eng.add(8, 50, tenant="a")
    eng.add(1, 50, tenant="b")
    eng.step()
    eng.sched.max_num_batched_tokens = 6
    eng.add(4, 5, tenant="a", priority=0)     # r2
    eng.add(4, 5, tenant="b", priority=0)     # r3
    eng.add(4, 5, tenant="a", priority=-5)    # r4
    assert names(eng.step()) == [("r1", 1), ("r0", 1), ("r3", 4)]
    assert names(eng.step()) == [("r1", 1), ("r3", 1), ("r0", 1), ("r4", 3)]
    eng.run()


def test_newcomer_gets_no_banked_credit(tmp_path):
    """a and b run for a while (counters in the hundreds). c, idle so far (counter 0),
    arrives: it starts at the least counter of the active tenants, not at 0, so it cannot
    monopolise the engine to 'catch up'."""
    eng = SchedulerHarness(tmp_path, num_blocks=256, max_num_batched_tokens=16)
    for _ in range(6):
        eng.add(20, 20, tenant="a")
        eng.add(20, 20, tenant="b")
    for _ in range(30):
        eng.step()
    active_min = min(counter(eng, "a"), counter(eng, "b"))
    assert active_min > 100
    eng.add(20, 20, tenant="c")
    assert counter(eng, "c") == active_min
    eng.run()


def test_idle_tenant_returns_at_high_water_when_nobody_is_active(tmp_path):
    """a works alone (counter 20), goes idle; b arrives while nobody is active: b starts at
    the class's high-water mark 20, so a's earlier service is not held against it later."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=64)
    eng.add(20, 1, tenant="a")
    eng.run()
    assert counter(eng, "a") == 20 + 0   # the last token is sampled in the prefill step
    eng.add(4, 1, tenant="b")
    assert counter(eng, "b") == 20
    eng.run()


@pytest.mark.parametrize("weights", [(1.0, 1.0), (1.0, 3.0)])
def test_vtc_bound_holds_at_every_step(tmp_path, weights):
    """Two tenants in one class, b sending 4x a's requests, for 600 steps. At every step
    where both are backlogged (both have sequences waiting), their weighted service differs
    by at most VTC's bound 2 x max(w_p x L_input, w_q x M), w_p = 1, w_q = 2, with L_input
    the longest prompt (48) and M the most tokens the running batch can hold: 40 blocks of 4
    = 160. Bound: 2 x max(48, 320) = 640. Over the run, service is shared by weight."""
    rng = random.Random(7)  # noqa: S311 - a seeded test workload, not a secret
    longest, num_blocks, bs = 48, 40, 4
    eng = SchedulerHarness(tmp_path, num_blocks=num_blocks, block_size=bs, max_num_batched_tokens=32,
                           max_num_seqs=8)
    wa, wb = weights
    bound = 2 * max(PREFILL_COST * longest, DECODE_COST * num_blocks * bs)
    checked = 0
    start = None
    for step in range(600):
        waiting = {t: sum(1 for s in eng.sched.waiting if s.state.req.tenant == t) for t in ("a", "b")}
        if waiting["a"] < 1:
            eng.add(rng.randint(8, longest), rng.randint(4, 24), tenant="a", weight=wa)
        for _ in range(4 - min(waiting["b"], 4)):
            eng.add(rng.randint(8, longest), rng.randint(4, 24), tenant="b", weight=wb)
        if step == 50:
            start = (counter(eng, "a"), counter(eng, "b"))
        eng.step()
        backlogged = eng.sched.fair.backlogged(ONLINE)
        both_waiting = all(any(s.state.req.tenant == t for s in eng.sched.waiting) for t in ("a", "b"))
        if both_waiting and len(backlogged) == 2:
            gap = abs(counter(eng, "a") - counter(eng, "b"))
            assert gap <= bound, f"step {step}: gap {gap} over the bound {bound}"
            checked += 1
    assert checked > 400
    # weighted service from step 50 on: each tenant's counter grew by about as much
    da, db = counter(eng, "a") - start[0], counter(eng, "b") - start[1]
    assert abs(da - db) <= bound and min(da, db) > 2 * bound
    for seq in list(eng.sched.waiting) + list(eng.sched.running):
        eng.sched.finish(seq, "abort")


def test_fcfs_is_unfair_to_the_light_tenant(tmp_path):
    """The same load under fcfs: the heavy tenant (4x the requests) gets most of the
    service. This is the baseline the fairness policy is measured against."""
    eng = SchedulerHarness(tmp_path, num_blocks=400, max_num_batched_tokens=32, max_num_seqs=8,
                           scheduling_policy="fcfs")
    for i in range(200):
        if i % 5 == 0:
            eng.add(16, 8, tenant="a")
        else:
            eng.add(16, 8, tenant="b")
    for _ in range(150):
        eng.step()
    sa = eng.sched.tenant_stats[(ONLINE, "a")]
    sb = eng.sched.tenant_stats[(ONLINE, "b")]
    served_a = sa.prefill_tokens + 2 * sa.decode_tokens
    served_b = sb.prefill_tokens + 2 * sb.decode_tokens
    assert served_b > 3 * served_a
    for seq in list(eng.sched.waiting) + list(eng.sched.running):
        eng.sched.finish(seq, "abort")


def test_lone_tenant_gets_the_whole_machine(tmp_path):
    """Work-conserving: with one tenant backlogged, every step uses the full budget of 16."""
    eng = SchedulerHarness(tmp_path, num_blocks=256, max_num_batched_tokens=16, max_num_seqs=16)
    for _ in range(10):
        eng.add(30, 10, tenant="solo")
    outs = [eng.step() for _ in range(10)]
    assert all(o.num_batched_tokens == 16 for o in outs)
    eng.run()


def test_preempted_offline_keeps_its_place(tmp_path):
    """10 blocks of 4. Offline O1 and O2 (16-token prompts) take 4 blocks each. An online
    request of 8 tokens takes the last 2 (its prompt step runs nothing offline). The next
    step its decode needs a third block, and O1's and O2's first decodes a fifth each: the
    least urgent running sequence, O2 (same class and tenant as O1, later arrival), is
    preempted. O3, an offline request that arrives afterwards, queues behind O2."""
    eng = SchedulerHarness(tmp_path, num_blocks=10, max_num_batched_tokens=64)
    o1 = eng.add(16, 3, cls="offline", tenant="t")
    o2 = eng.add(16, 3, cls="offline", tenant="t")
    eng.step()
    on = eng.add(8, 3, cls="online", tenant="u")
    out = eng.step()
    assert [s for s, _ in out.scheduled] == [on.seqs[0]] and not out.preempted
    out = eng.step()
    assert out.preempted == [o2.seqs[0]] and on.seqs[0] in [s for s, _ in out.scheduled]
    o3 = eng.add(4, 1, cls="offline", tenant="t")
    waiting_offline = [s for s in sorted(eng.sched.waiting, key=eng.sched.key)
                       if s.state.req.service_class == "offline"]
    assert waiting_offline == [o2.seqs[0], o3.seqs[0]]
    eng.run()
    assert o1.seqs[0].num_output_tokens == 3 and o2.seqs[0].num_output_tokens == 3
    assert eng.sched.stats_of(o2.seqs[0]).preemptions == 1


def test_offline_finishes_under_constant_online_pressure(tmp_path):
    """No livelock. 12 blocks of 4 = 48 slots; offline prompts of 20 tokens (5 blocks,
    barely two fit). Every third step a short online request arrives (8 tokens, 2 blocks,
    2 outputs), forever. Offline requests are preempted again and again, yet each finishes
    (each return reuses its cached prompt blocks), and the online ones all finish too."""
    eng = SchedulerHarness(tmp_path, num_blocks=12, max_num_batched_tokens=32, max_num_seqs=8)
    offline = [eng.add(20, 12, cls="offline", tenant=f"o{i}") for i in range(4)]
    online = []
    for step in range(600):
        if step % 3 == 0:
            online.append(eng.add(8, 2, cls="online", tenant="u"))
        eng.step()
        if all(s.status is SeqStatus.FINISHED for st in offline for s in st.seqs):
            break
    assert all(s.status is SeqStatus.FINISHED and s.num_output_tokens == 12
               for st in offline for s in st.seqs), "offline work starved"
    assert eng.sched.num_preemptions > 0
    eng.run()
    assert all(st.seqs[0].num_output_tokens == 2 for st in online)


def test_reserved_kv_keeps_room_for_online(tmp_path):
    """20 blocks, reserved_kv_fraction online 0.25 -> 5 blocks offline may not take.
    Offline requests of 16 tokens (4 blocks + 1 for growth) fill at most 15 blocks; an
    online request of 16 tokens then gets in without preempting anything."""
    eng = SchedulerHarness(tmp_path, num_blocks=20, max_num_batched_tokens=256,
                           reserved_kv_fraction={"online": 0.25})
    assert eng.sched.reserve_by_rank == [0, 0, 5]   # priority, online, offline
    for _ in range(5):
        eng.add(16, 8, cls="offline", tenant="t")
    for _ in range(3):
        eng.step()
        assert eng.kv.num_free_blocks >= 5
    on = eng.add(16, 2, cls="online", tenant="u")
    out = eng.step()
    assert not out.preempted and on.seqs[0].status is SeqStatus.RUNNING
    eng.run()


def test_offline_cached_blocks_are_evicted_before_online_ones(tmp_path):
    """8 blocks of 4. An online and an offline request, 16 tokens each, finish; each leaves
    4 cached blocks (online's in the protected tier). A new 16-token request needs 4 fresh
    blocks (+1): they come from the offline request's cache; the online prefix survives."""
    eng = SchedulerHarness(tmp_path, num_blocks=10, max_num_batched_tokens=64)
    p_on, p_off = list(range(1000, 1016)), list(range(2000, 2016))
    eng.add(16, 1, cls="online", prompt=p_on, tenant="t")
    eng.add(16, 1, cls="offline", prompt=p_off, tenant="t")
    eng.run()
    eng.add(16, 1, cls="online", prompt=list(range(3000, 3016)), tenant="t")
    eng.run()
    again_on = eng.add(16, 1, cls="online", prompt=p_on, tenant="t")
    again_off = eng.add(16, 1, cls="offline", prompt=p_off, tenant="t")
    eng.step()
    assert again_on.num_cached_tokens == 12          # 3 full blocks (one token left to compute)
    assert again_off.num_cached_tokens < 12
    eng.run()


def test_prefix_cache_is_salted_by_tenant(tmp_path):
    """The same 13-token prompt: tenant b after a gets no hit; a again gets 12 cached
    tokens; two tenants of one share group both hit."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=64)
    prompt = list(range(700, 713))

    def cached(**kw):
        st = eng.add(13, 1, prompt=prompt, **kw)
        eng.run()
        return st.num_cached_tokens

    assert cached(tenant="a") == 0
    assert cached(tenant="b") == 0
    assert cached(tenant="a") == 12
    assert cached(tenant="c", share_group="g") == 0
    assert cached(tenant="d", share_group="g") == 12


def test_randomized_tenants_classes_and_aborts(tmp_path):
    """3000 steps of random arrivals over 4 tenants (random weights), all three classes, n up to
    3, random lengths and aborts, with a reserve for online. At every step: the invariants
    (no block leaked or freed twice, budgets), no offline sequence running while an online
    one waits with budget left, and the fairness counters never decrease."""
    rng = random.Random(99)  # noqa: S311 - a seeded test workload, not a secret
    eng = SchedulerHarness(tmp_path, num_blocks=48, block_size=4, max_num_batched_tokens=24,
                           max_num_seqs=6, reserved_kv_fraction={"online": 0.125})
    tenants = {f"t{i}": rng.choice([0.5, 1.0, 2.0]) for i in range(4)}
    states = []
    last = {}
    for step in range(3000):
        if rng.random() < 0.3:
            t = rng.choice(list(tenants))
            states.append(eng.add(rng.randint(1, 60), rng.randint(1, 30), cls=rng.choice(CLASSES),
                                  n=rng.choice([1, 1, 1, 2, 3]), tenant=t, weight=tenants[t]))
        if rng.random() < 0.03 and states:
            for seq in rng.choice(states).seqs:
                eng.sched.finish(seq, "abort")
        out = eng.step()
        priority_prefilled = eng.sched.sizer.min_prefill_rank < ONLINE   # the step's most urgent prefill
        # (a step where priority prefills gives less urgent classes no prefill: step sizing)
        if out.num_batched_tokens < eng.cfg.max_num_batched_tokens and not priority_prefilled:
            online_waiting = [s for s in eng.sched.waiting if s.state.req.service_class == "online"
                              and s.index == 0 and s not in out.preempted]
            offline_running = [s for s in eng.sched.running if s.state.req.service_class == "offline"]
            assert not (online_waiting and offline_running), f"step {step}: offline ran while online waited"
        for rank, cs in eng.sched.fair.counters.items():
            for t, c in cs.items():
                assert c >= last.get((rank, t), 0.0) - 1e-9, f"step {step}: counter of {t} went down"
                last[(rank, t)] = c
    eng.run()
    assert eng.sched.num_preemptions > 0


def test_prefill_token_budget_keeps_background_steps_short(tmp_path):
    """Budget 64, offline prefill capped at 8 tokens a step. Two 20-token offline prompts:
    each step computes at most 8 of their tokens, so an online arrival never waits behind a
    long step. The online prompt (30 tokens, not capped) then gets a step with no offline
    prefill at all (only decodes would join it); the next step goes on with offline."""
    eng = SchedulerHarness(tmp_path, num_blocks=64, max_num_batched_tokens=64,
                           prefill_token_budget={"offline": 8})
    eng.add(20, 4, cls="offline", tenant="t")
    eng.add(20, 4, cls="offline", tenant="t")
    assert names(eng.step()) == [("r0", 8)]
    assert names(eng.step()) == [("r0", 8)]
    on = eng.add(30, 2, cls="online", tenant="u")
    out = eng.step()
    assert names(out) == [("r2", 30)]
    assert on.seqs[0].num_output_tokens == 1
    assert names(eng.step()) == [("r2", 1), ("r0", 4), ("r1", 4)]
    eng.run()


def test_tenant_holding_no_slot_gets_one_within_two_steps(tmp_path):
    """4 sequence slots. Tenant x runs 4 long requests (200 outputs each) and queues 2 more;
    then tenant y sends one short request. y holds no slot while x holds all four, so x's
    newest running request is preempted (its blocks freed, queued for recomputation) and y
    runs within 2 steps, not after x's 200-step requests. y then holds a slot, so nothing
    more is preempted for it; every request finishes, the preempted one exactly once
    preempted."""
    eng = SchedulerHarness(tmp_path, num_blocks=512, max_num_seqs=4)
    xs = [eng.add(8, 200, tenant="x") for _ in range(6)]
    for _ in range(3):
        eng.step()
    assert [s.seqs[0].status for s in xs] == [SeqStatus.RUNNING] * 4 + [SeqStatus.WAITING] * 2
    y = eng.add(8, 2, tenant="y")
    steps = 0
    while y.seqs[0].status is not SeqStatus.RUNNING and steps < 50:
        eng.step()
        steps += 1
    assert steps <= 2, f"y waited {steps} steps for a slot"
    assert [s.seqs[0].num_preemptions for s in xs[:4]] == [0, 0, 0, 1]
    eng.run()
    assert [s.seqs[0].num_output_tokens for s in xs] == [200] * 6
    assert eng.sched.num_preemptions == 1


def test_floor_never_takes_a_tenants_last_slot(tmp_path):
    """2 slots, tenants a and b run one request each; c's request waits: neither holds more
    than one slot, so nothing is preempted for c, which runs once one of them ends."""
    eng = SchedulerHarness(tmp_path, num_blocks=128, max_num_seqs=2)
    a, b = eng.add(8, 20, tenant="a"), eng.add(8, 30, tenant="b")
    eng.step()
    c = eng.add(8, 2, tenant="c")
    for _ in range(10):
        eng.step()
        assert c.seqs[0].status is SeqStatus.WAITING
    eng.run()
    assert eng.sched.num_preemptions == 0
    assert [s.seqs[0].num_output_tokens for s in (a, b, c)] == [20, 30, 2]
