"""The speculation switch (engine/spec/switch.py) against a fitted step-cost model: drafts
on while a row's extra time as a 1 + d token chunk is worth its expected kept tokens."""

from __future__ import annotations

import random

from lockgate.engine.cost_model import StepCostModel, StepShape
from lockgate.engine.request import EngineRequest, RequestState, Sequence
from lockgate.engine.sampling_params import SamplingParams
from lockgate.engine.spec.switch import PROBE_EVERY, SpecSwitch

# the machine the model is fitted to: 5 ms a step, 0.1 ms a sequence, 0.05 ms a prefill
# token, 0.1 ms a sampled row
CONST_S, SEQ_S, TOKEN_S, SAMPLE_S = 5e-3, 1e-4, 5e-5, 1e-4


def fitted_cost() -> StepCostModel:
    """A cost model fitted to 60 steps of the machine above, decodes and chunks mixed."""
    cost = StepCostModel()
    rng = random.Random(0)  # noqa: S311 (test data)
    for _ in range(60):
        shape = StepShape()
        for _ in range(rng.randrange(1, 64)):
            shape.add_decode(rng.randrange(10, 500))
        for _ in range(rng.randrange(0, 3)):
            shape.add_prefill(rng.randrange(1, 300), rng.randrange(0, 200), rng.random() < 0.5)
        cost.observe(shape, CONST_S + SEQ_S * shape.num_seqs + TOKEN_S * shape.prefill_tokens
                     + SAMPLE_S * shape.sampled)
    assert cost.ready
    return cost


def decodes(num: int, rank: int = 1) -> list[Sequence]:
    """`num` running decodes of class `rank`, 200 tokens each (one to compute)."""
    out = []
    for i in range(num):
        state = RequestState(EngineRequest(f"r{i}", [1] * 150, SamplingParams()), class_rank=rank)
        seq = Sequence(state, 0, [1] * 200, 150, num_computed_tokens=199)
        state.seqs.append(seq)
        out.append(seq)
    return out


def test_one_row_drafts_many_rows_only_while_enough_is_kept():
    """k = 4. One row: the step is 5.2 ms; as a 5-token chunk instead of a decode the row
    adds 5 tokens and 4 sampled rows, 0.25 + 0.4 = 0.65 ms, and even 10% of 4 drafts kept
    wins 0.4 x 5.2 ms: on. 256 rows: a decode row's share of the step is 5 / 256 + 0.2 =
    0.22 ms; 10% kept wins 0.09 ms < 0.65 ms: off; all 4 kept win 0.88 ms > 0.65 ms: on."""
    cost = fitted_cost()
    switch = SpecSwitch(3, 4)
    switch.acceptance[1] = 0.1
    switch.begin(decodes(1), cost)
    assert switch.enabled[1]
    switch.begin(decodes(256), cost)
    assert not switch.enabled[1]
    switch.acceptance[1] = 1.0
    switch.begin(decodes(256), cost)
    assert switch.enabled[1]


def test_a_switched_off_class_probes_every_few_steps_and_learns():
    """Off with 256 rows at 10% kept; every PROBE_EVERY-th step it drafts once; rows that
    keep all their drafts raise the running acceptance until drafts pay again."""
    cost = fitted_cost()
    switch = SpecSwitch(3, 4)
    switch.acceptance[1] = 0.1
    batch = decodes(256)
    seen = []
    for _ in range(2 * PROBE_EVERY):
        switch.begin(batch, cost)
        seen.append(switch.enabled[1])
    assert [i + 1 for i, on in enumerate(seen) if on] == [PROBE_EVERY, 2 * PROBE_EVERY]
    for _ in range(40):
        switch.observe(1, 4, 4)
    switch.begin(batch, cost)
    assert switch.enabled[1] and switch.acceptance[1] > 0.95


def test_classes_decide_apart_and_unfitted_or_manual_means_on():
    """Class 0 (few rows, decided on) and class 1 (many rows, 0% kept) in one step; a cost
    model not yet fitted, or auto_disable false, leaves drafts on."""
    cost = fitted_cost()
    switch = SpecSwitch(3, 4)
    switch.acceptance[1] = 0.0
    switch.begin(decodes(2, rank=0) + decodes(254, rank=1), cost)
    assert switch.enabled[:2] == [True, False]
    switch.begin(decodes(256), StepCostModel())
    assert switch.enabled[1]
    manual = SpecSwitch(3, 4, auto=False)
    manual.acceptance[1] = 0.0
    manual.begin(decodes(256), cost)
    assert manual.enabled[1]
