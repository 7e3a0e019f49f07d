"""Scheduler and KV cache with a fake model runner (every sampled token is 7). Each test is
a worked example: the docstring does the block arithmetic."""

from __future__ import annotations

import random

import pytest

from lockgate.engine.request import SeqStatus
from tests.support.scheduler_harness import CLASSES, SchedulerHarness, names


def test_decodes_first_then_prefill_chunks(tmp_path):
    """Budget 10 tokens, blocks of 4. A (6-token prompt) and B (20-token prompt) arrive.
    step 1: A prefills 6, B gets the remaining 4 as a first chunk.
    step 2: A decodes 1 first; B's next chunk takes the other 9 (tokens 4..12).
    step 3: A decodes 1; B takes 7 (tokens 13..19) and samples its first token."""
    eng = SchedulerHarness(tmp_path, num_blocks=32, max_num_batched_tokens=10)
    eng.add(6, max_tokens=5)
    eng.add(20, max_tokens=2)
    assert names(eng.step()) == [("r0", 6), ("r1", 4)]
    assert names(eng.step()) == [("r0", 1), ("r1", 9)]
    assert names(eng.step()) == [("r0", 1), ("r1", 7)]
    assert names(eng.step()) == [("r0", 1), ("r1", 1)]
    eng.run()


def test_long_prompt_never_stalls_running_decodes(tmp_path):
    """A 400-token prompt arrives while A decodes; budget 16. Every step A decodes once
    and the prompt takes the remaining 15 tokens: 26 steps of 15 and a last one of 10
    (400 = 26 x 15 + 10), A never skipped."""
    eng = SchedulerHarness(tmp_path, num_blocks=200, max_num_batched_tokens=16)
    a = eng.add(5, max_tokens=40)
    eng.step()
    eng.add(400, max_tokens=1)
    for i in range(27):
        out = eng.step()
        assert out.scheduled[0][0] is a.seqs[0] and out.scheduled[0][1] == 1
        assert out.num_batched_tokens == (16 if i < 26 else 11)
    eng.run()


def test_preemption_frees_blocks_and_keeps_place_in_line(tmp_path):
    """6 blocks of 4 = 24 token slots. A, B, C each have 7-token prompts (2 blocks each,
    6 blocks in all). At their 9th token all three need a third block and none is free:
    the least urgent (C, the last to arrive) is preempted, its 2 blocks go to A and B.
    C waits at the head of the line, ahead of D that arrived later."""
    eng = SchedulerHarness(tmp_path, num_blocks=6, max_num_batched_tokens=64)
    a, b, c = (eng.add(7, max_tokens=6) for _ in range(3))
    eng.step()                      # prefill 7 each, sample 8th token
    assert eng.kv.num_free_blocks == 0
    out = eng.step()                # decode token 8 fits in block 2 (positions 4..7)
    out = eng.step()                # token 9 needs a third block each
    assert out.preempted == [c.seqs[0]]
    assert [s for s, _ in out.scheduled] == [a.seqs[0], b.seqs[0]]
    assert c.seqs[0].status is SeqStatus.PREEMPTED and c.seqs[0].num_computed_tokens == 0
    d = eng.add(3, max_tokens=1)
    assert sorted(eng.sched.waiting, key=eng.sched.key)[0] is c.seqs[0]
    eng.run()
    assert c.seqs[0].num_output_tokens == 6 and d.seqs[0].num_output_tokens == 1


def test_online_request_preempts_offline_work(tmp_path):
    """8 blocks of 4. Two offline requests of 14 tokens take 4 blocks each (16 slots).
    An online 5-token prompt needs 2 blocks: the least urgent offline one (the later) is
    preempted for it. Under fcfs the online request waits instead."""
    for policy in ("priority", "fcfs"):
        eng = SchedulerHarness(tmp_path, num_blocks=8, max_num_batched_tokens=64, scheduling_policy=policy)
        eng.add(14, 2, cls="offline")
        off2 = eng.add(14, 2, cls="offline")
        eng.step()
        assert eng.kv.num_free_blocks == 0
        on = eng.add(5, 2, cls="online")
        out = eng.step()
        if policy == "priority":
            assert out.preempted == [off2.seqs[0]]
            assert on.seqs[0] in [s for s, _ in out.scheduled]
        else:
            assert out.preempted == []
            assert on.seqs[0].status is SeqStatus.WAITING
        eng.run()


def test_sequence_cap_lets_online_in_by_preempting_offline(tmp_path):
    """max_num_seqs = 2 and two offline requests run: an online arrival takes the slot of
    the less urgent one (the sequence cap counts like missing blocks)."""
    eng = SchedulerHarness(tmp_path, num_blocks=100, max_num_batched_tokens=64, max_num_seqs=2)
    eng.add(4, 10, cls="offline")
    off2 = eng.add(4, 10, cls="offline")
    eng.step()
    on = eng.add(4, 3, cls="online")
    out = eng.step()
    assert out.preempted == [off2.seqs[0]] and on.seqs[0].status is SeqStatus.RUNNING
    eng.run()


def test_n_samples_share_the_prompt_blocks(tmp_path):
    """n=3, a 10-token prompt, blocks of 4: the leader computes blocks [0-3], [4-7], [8-9].
    Samples 1 and 2 adopt the two full blocks by reference (ref count 3) and compute only
    tokens 8 and 9 into a block of their own: 3 + 1 + 1 = 5 blocks, not 9."""
    eng = SchedulerHarness(tmp_path, num_blocks=32, max_num_batched_tokens=64, enable_prefix_caching=False)
    st = eng.add(10, max_tokens=3, n=3)
    eng.step()   # the leader's prompt; siblings wait for it
    out = eng.step()
    lead, s1, s2 = st.seqs
    shared = eng.kv.blocks_of(lead)[:2]
    assert eng.kv.blocks_of(s1)[:2] == shared and eng.kv.blocks_of(s2)[:2] == shared
    assert [b.ref_cnt for b in shared] == [3, 3]
    assert eng.kv.num_used_blocks == 5
    assert [n for s, n in out.scheduled if s in (s1, s2)] == [2, 2]
    eng.run()


def test_prefix_cache_hit_reuses_blocks_and_lru_evicts_tail_first(tmp_path):
    """Blocks of 4. A 13-token prompt fills blocks 0-2 fully (12 tokens) plus one token.
    After A finishes, B with the same first 12 tokens + 3 others hits 3 blocks (12 tokens).
    A full hit stops one token short: the last token must be computed for its logits."""
    eng = SchedulerHarness(tmp_path, num_blocks=16, max_num_batched_tokens=64)
    prompt = list(range(500, 513))
    eng.add(13, 1, prompt=prompt)
    eng.run()
    b = eng.add(15, 1, prompt=[*prompt[:12], 1, 2, 3])
    out = eng.step()
    assert b.num_cached_tokens == 12 and names(out) == [("r1", 3)]
    eng.run()
    c = eng.add(12, 1, prompt=prompt[:12])    # full hit on 3 blocks: only 2 are used
    eng.step()
    assert c.num_cached_tokens == 8
    eng.run()


@pytest.mark.parametrize("policy", ["priority", "fcfs"])
def test_randomized_invariants(tmp_path, policy):
    """Thousands of steps with random arrivals, classes, n, lengths and aborts; at every
    step: no block leaked or freed twice, budgets kept, blocks match tokens, and (priority)
    no offline sequence runs while an online one waits with budget left."""
    rng = random.Random(1234)  # noqa: S311 - a seeded test workload, not a secret
    eng = SchedulerHarness(tmp_path, num_blocks=40, block_size=4, max_num_batched_tokens=24,
                           max_num_seqs=6, scheduling_policy=policy)
    states = []
    for step in range(3000):
        if rng.random() < 0.3:
            states.append(eng.add(rng.randint(1, 60), rng.randint(1, 30),
                                  cls=rng.choice(CLASSES), n=rng.choice([1, 1, 1, 2, 3])))
        if rng.random() < 0.03 and states:
            st = rng.choice(states)
            for seq in st.seqs:
                eng.sched.finish(seq, "abort")
        out = eng.step()
        if policy == "priority" and out.num_batched_tokens < eng.cfg.max_num_batched_tokens:
            online_waiting = [s for s in eng.sched.waiting if s.state.req.service_class == "online"
                              and s.index == 0 and s not in out.preempted]
            offline_running = [s for s in eng.sched.running if s.state.req.service_class == "offline"]
            assert not (online_waiting and offline_running), f"step {step}: offline ran while online waited"
    eng.run()
    assert eng.sched.num_preemptions > 0
    eng.kv.check_integrity()


def test_running_prefill_continues_while_an_earlier_waiting_sequence_cannot_fit(tmp_path):
    """Regression: 6 blocks of 4, budget 13, fcfs. A preempted sequence W (earlier arrival)
    waits for blocks that R, a later sequence in the middle of its chunked prefill, holds.
    W's admission fails, but R's prefill must go on (and finish, and free its blocks);
    stopping all prefill work there left R stuck forever."""
    eng = SchedulerHarness(tmp_path, num_blocks=6, max_num_batched_tokens=13,
                           scheduling_policy="fcfs", enable_prefix_caching=False)
    eng.add(4, 8)
    eng.add(12, 10)
    eng.add(20, 11)
    steps = eng.run(max_steps=500)
    assert sum(len(o.preempted) for o in steps) > 0


def test_randomized_adapters_never_exceed_max_loras_and_all_get_served(tmp_path):
    """3000 steps of random arrivals over six adapters and the base model, max_loras 2, one
    adapter five times as popular as each other one: at every step at most two adapters
    run (check_invariants), and at the end every request of every adapter has finished."""
    from lockgate.engine.lora import LoRARequest

    rng = random.Random(99)  # noqa: S311 - a seeded test workload, not a secret
    eng = SchedulerHarness(tmp_path, num_blocks=48, block_size=4, max_num_batched_tokens=24, max_num_seqs=6,
                           enable_lora=True, max_loras=2)
    adapters = [None] + [LoRARequest(f"a{i}", i, "/unused") for i in range(1, 7)]
    weights = [2, 5, 1, 1, 1, 1, 1]
    states = []
    for _ in range(3000):
        if rng.random() < 0.3:
            lora = rng.choices(adapters, weights)[0]
            states.append(eng.add(rng.randint(1, 30), rng.randint(1, 12), cls=rng.choice(CLASSES),
                                  n=rng.choice([1, 1, 2]), lora=lora))
        eng.step()
    eng.run()
    assert all(s.finished for s in states)
    served = {s.req.lora_id for s in states}
    assert served == set(range(7))
