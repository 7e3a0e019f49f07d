"""Speculative decoding end to end (engine/spec/decode.py): the same output with and without
drafts on a random demo model (where n-gram drafts are not kept), with chunked prefill, prefix
caching and preemption in the runs; an oracle proposer kept whole, a wrong one changing nothing.
The copy demo model (whose greedy output quotes its prompt, so drafts are kept), both proposers,
with an adapter and a schema in the runs: tests/engine/test_spec_matrix.py."""

from __future__ import annotations

import pytest
import torch

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.demo_tokenizer import _corpus
from lockgate.engine.tokenizer import Tokenizer
from tests.support.helpers import copy_model, demo_model, random_prompts

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def quoting_prompts(model_dir: str, num: int) -> list[list[int]]:
    """A shared opening (two blocks: prefix-cache hits), then a few sentences of the demo
    tokenizer's text and their first tokens again: the copy model goes on quoting them."""
    tok = Tokenizer(model_dir)
    corpus = _corpus()
    opening = tok.encode(" ".join(corpus[100:103]))[:32]
    out = []
    for i in range(num):
        src = tok.encode(" ".join(corpus[3 * i:3 * i + 3 + i % 3]))
        out.append(opening + src + src[:6])
    return out


def run(model_dir: str, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
        spec: dict | None, proposer=None, **engine):
    """(outputs, engine stats) of one LLM.generate."""
    llm = LLM(model_dir, speculative_config=spec, **engine)
    if proposer is not None:
        llm.engine.spec.proposer = proposer
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    return outs, llm.engine.stats()


def token_ids(outs) -> list[list[list[int]]]:
    return [[list(c.token_ids) for c in o.outputs] for o in outs]


GREEDY_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
GREEDY_128 = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
# batch 32 with too few blocks for every sequence's 200-odd tokens: preemption; budget
# 256: long prompts are chunked
BATCH_32 = {"max_num_batched_tokens": 256, "num_kv_blocks": 160}


def test_greedy_batch_1_is_the_same_with_drafts_on_random_text():
    """8 prompts one at a time (max_num_seqs 1), 64 tokens each, chunks of 48 tokens. (The
    cache is kept small throughout: the invariant check walks every block each step.)"""
    model = demo_model()
    prompts = random_prompts(model, [40, 70, 90] * 2 + [20, 130])
    engine = {"max_num_seqs": 1, "max_num_batched_tokens": 48, "num_kv_blocks": 64}
    plain, _ = run(model, prompts, GREEDY_64, None, **engine)
    spec, stats = run(model, prompts, GREEDY_64, NGRAM, **engine)
    assert token_ids(spec) == token_ids(plain)
    assert [o.outputs[0].text for o in spec] == [o.outputs[0].text for o in plain]
    s = stats.spec
    assert s is not None and s.num_drafts > 0
    print(f"\nrandom: {s.num_accepted_tokens}/{s.num_draft_tokens} draft tokens kept, {stats.num_steps} steps")


def test_greedy_batch_32_with_preemption_is_the_same_with_drafts_on_random_text():
    """40 prompts (32 run at once), 128 tokens each, 160 blocks of 16 for ~230-token
    sequences: preempted and recomputed; a shared opening: prefix-cache hits."""
    model = demo_model()
    opening = random_prompts(model, [32], seed=1)[0]
    prompts = [opening + p for p in random_prompts(model, [20 + 7 * (i % 10) for i in range(40)])]
    engine = {"max_num_seqs": 32, **BATCH_32}
    plain, plain_stats = run(model, prompts, GREEDY_128, None, **engine)
    spec, stats = run(model, prompts, GREEDY_128, NGRAM, **engine)
    assert token_ids(spec) == token_ids(plain)
    assert stats.num_preemptions > 0 and plain_stats.num_preemptions > 0
    assert stats.kv.prefix_cache_hits > 0
    s = stats.spec
    assert s is not None and s.num_drafts > 0 and s.classes["online"].num_drafts == s.num_drafts
    assert sum(s.accepted_per_pos) == s.num_accepted_tokens
    print(f"\nrandom: {s.num_accepted_tokens}/{s.num_draft_tokens} kept, steps {plain_stats.num_steps} -> "
          f"{stats.num_steps}, preemptions {stats.num_preemptions}")


PENALIZED_64 = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, repetition_penalty=1.2,
                              frequency_penalty=1.0, presence_penalty=0.5)


@pytest.mark.parametrize("params", [GREEDY_64, PENALIZED_64], ids=["greedy", "penalized"])
def test_an_oracle_proposer_is_kept_whole_and_a_wrong_one_changes_nothing(params):
    """The oracle proposes the true greedy continuation (from a run without drafts): every
    draft token is kept (with penalties too: the row of each position counts the drafts
    before it). The wrong one proposes tokens the model never picks: none is kept, and the
    output is the same (the switch is off, so every decode carries a draft)."""
    model = demo_model()
    prompts = random_prompts(model, [30, 50, 17, 64, 9, 40])
    engine = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "num_kv_blocks": 40}
    plain, plain_stats = run(model, prompts, params, None, **engine)
    truth = {tuple(p): o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)}

    def oracle(seq, k):
        return truth[tuple(seq.state.req.prompt_token_ids)][seq.num_output_tokens:seq.num_output_tokens + k]

    spec, stats = run(model, prompts, params, NGRAM, oracle, **engine)
    assert token_ids(spec) == token_ids(plain)
    s = stats.spec
    assert s.num_draft_tokens > 0 and s.num_accepted_tokens == s.num_draft_tokens
    assert s.accepted_per_pos[0] == s.num_drafts
    assert stats.num_steps < plain_stats.num_steps / 3

    def wrong(seq, k):
        return [(t + 1) % 512 for t in truth[tuple(seq.state.req.prompt_token_ids)][seq.num_output_tokens:][:k]]

    spec, stats = run(model, prompts, params, {**NGRAM, "auto_disable": False}, wrong, **engine)
    assert token_ids(spec) == token_ids(plain)
    assert stats.spec.num_draft_tokens > 0 and stats.spec.num_accepted_tokens == 0


def test_lora_rows_draft_and_keep_their_adapters_output(tmp_path):
    """Three adapters and the base model in one batch, the oracle proposing each row's own
    continuation under its adapter: every draft kept, the output as without drafts."""
    pytest.importorskip("peft")
    from lockgate.engine import LoRARequest
    from lockgate.engine.lora_demo import write_demo_adapter

    base = demo_model()
    adapters = [LoRARequest(name, i + 1, str(write_demo_adapter(base, tmp_path / name, rank=rank, targets=t,
                                                                seed=i + 1)))
                for i, (name, rank, t) in enumerate([("qv", 8, "q,v"), ("all", 4, "q,k,v,o,gate,up,down"),
                                                     ("mlp", 16, "gate,up,down")])]
    loras = [adapters[0], None, adapters[1], adapters[2], None, adapters[0], adapters[1], adapters[2]]
    prompts = random_prompts(base, [5, 17, 33, 9, 64, 40, 3, 100], seed=11)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run_lora(spec, proposer=None):
        llm = LLM(base, enable_lora=True, max_loras=3, max_lora_rank=16, max_num_batched_tokens=64,
                  num_kv_blocks=64, speculative_config=spec)
        if proposer is not None:
            llm.engine.spec.proposer = proposer
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                            use_progress_bar=False)
        return outs, llm.engine.stats()

    plain, _ = run_lora(None)
    truth = {(tuple(p), lr.lora_name if lr else None): o.outputs[0].token_ids
             for p, lr, o in zip(prompts, loras, plain, strict=True)}

    def oracle(seq, k):
        lr = seq.state.req.lora_request
        done = seq.num_output_tokens
        return truth[(tuple(seq.state.req.prompt_token_ids), lr.lora_name if lr else None)][done:done + k]

    spec, stats = run_lora(NGRAM, oracle)
    assert token_ids(spec) == token_ids(plain)
    assert stats.spec.num_draft_tokens > 0 and stats.spec.num_accepted_tokens == stats.spec.num_draft_tokens


def test_seeded_sampling_gives_the_tokens_it_gives_without_drafts():
    """Seeded sampled rows (n 2, top-p) draw each position's token with the sampler's own
    noise for that position: the same tokens with drafts as without, run after run, alone
    or beside other requests."""
    model = copy_model()
    prompts = quoting_prompts(model, 6)
    params = [SamplingParams(temperature=0.7, top_p=0.95, seed=100 + i, n=2, max_tokens=48, ignore_eos=True)
              for i in range(len(prompts))]
    engine = {"max_num_seqs": 16, "max_num_batched_tokens": 128, "num_kv_blocks": 128}
    plain, _ = run(model, prompts, params, None, **engine)
    spec, stats = run(model, prompts, params, NGRAM, **engine)
    again, _ = run(model, prompts, params, NGRAM, **engine)
    alone, _ = run(model, prompts[2:3], params[2:3], NGRAM, **engine)
    assert token_ids(spec) == token_ids(plain) == token_ids(again)
    assert token_ids(alone) == token_ids(plain)[2:3]
    assert stats.spec.num_accepted_tokens > 0


def test_stops_penalties_logprobs_and_max_tokens_as_without_drafts():
    """Emitted tokens go through the same stop path one by one: a stop string or stop token
    inside a kept draft ends the output there, max_tokens is never passed, penalties see
    the drafts before each position, logprobs come per emitted token."""
    model = copy_model()
    prompts = quoting_prompts(model, 5)
    llm = LLM(model, num_kv_blocks=64)
    quoted = token_ids(llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY_64,
                                    use_progress_bar=False))
    stop_text = llm.tokenizer.decode(quoted[0][0][20:23])
    params = [
        SamplingParams(temperature=0.0, max_tokens=64, stop=[stop_text]),
        SamplingParams(temperature=0.0, max_tokens=64, stop_token_ids=[quoted[1][0][17]]),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, repetition_penalty=1.3, presence_penalty=0.5,
                       frequency_penalty=0.3, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=40, logprobs=3, n=2, ignore_eos=True),
    ]
    engine = {"max_num_seqs": 8, "num_kv_blocks": 128}
    plain, _ = run(model, prompts, params, None, **engine)
    spec, stats = run(model, prompts, params, NGRAM, **engine)
    assert stats.spec.num_accepted_tokens > 0
    for a, b in zip(spec, plain, strict=True):
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (list(x.token_ids), x.text, x.finish_reason, x.stop_reason) == \
                   (list(y.token_ids), y.text, y.finish_reason, y.stop_reason)
            if y.logprobs is not None:
                assert x.logprobs is not None and len(x.logprobs) == len(y.logprobs) == 40
                for lx, ly in zip(x.logprobs, y.logprobs, strict=True):
                    assert lx.keys() == ly.keys()
                    # the same up to float32 rounding of logits ~30 (a chunk's matmuls are not a decode's)
                    assert [lx[t].logprob for t in lx] == pytest.approx([ly[t].logprob for t in lx], rel=1e-4, abs=1e-3)
    assert (spec[0].outputs[0].finish_reason, spec[0].outputs[0].stop_reason) == ("stop", stop_text)
    assert spec[1].outputs[0].stop_reason == quoted[1][0][17]
    assert len(spec[2].outputs[0].token_ids) == 13


def test_opted_out_requests_and_grammar_rows_decode_without_drafts():
    """`speculative=False` and a structured-output row get no drafts; the others do."""
    from lockgate.engine import StructuredOutputsParams

    model = copy_model()
    prompts = quoting_prompts(model, 2)
    off = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, speculative=False)
    _, stats = run(model, prompts, off, NGRAM, num_kv_blocks=32)
    assert stats.spec.num_drafts == 0
    grammar = SamplingParams(temperature=0.0, max_tokens=16,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]{1,12}"))
    _, stats = run(model, prompts, grammar, NGRAM, num_kv_blocks=32)
    assert stats.spec.num_drafts == 0
    with pytest.raises(Exception, match="speculative"):
        SamplingParams(speculative="no")


def test_drafts_crowd_out_neither_decodes_nor_arrivals(tmp_path):
    """The scheduler alone (tests/support/scheduler_harness.py), a proposer that always offers
    4 drafts, 8 requests of 4 prompt tokens and a budget of 12 tokens a step: a token is kept
    for every decode to come and up to half the budget for pending prompts, so every decode
    runs in every step and every request starts within 7 steps (without: 3 drafting decodes
    took all 12 tokens and the other 5 waited until they finished). No draft is ever kept: the rejected slots are
    released (the invariant check, every step)."""
    from lockgate.engine.spec.config import SpeculativeConfig
    from lockgate.engine.spec.decode import SpecDecoder
    from tests.support.scheduler_harness import CLASSES, SchedulerHarness

    h = SchedulerHarness(tmp_path, num_blocks=256, max_num_batched_tokens=12)
    spec = SpecDecoder(SpeculativeConfig.of(NGRAM), h.kv, CLASSES, [1 << 20] * len(CLASSES))
    spec.proposer = lambda seq, k: [9] * k
    h.sched.spec = spec
    states = [h.add(4, max_tokens=20) for _ in range(8)]
    num_drafted, started = 0, {}
    for step in range(400):
        if not h.sched.has_work:
            break
        out = h.sched.schedule()
        for seq, _ in out.scheduled:
            started.setdefault(seq.state.request_id, step)
        h.check(out)
        ran = {seq for seq, _ in out.scheduled}
        assert all(s in ran for s in h.sched.running if s.is_decode), out.scheduled
        num_drafted += len(out.drafts)
        h.sched.update(out, {seq: 0 for seq in out.drafts})
        for seq, _ in out.scheduled:
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    h.sched.finish(seq, "length")
    assert all(st.finished for st in states)
    assert max(started.values()) <= 6, started      # 32 prompt tokens, 6 or more a step
    assert num_drafted > 0 and h.kv.num_used_blocks == 0


def test_a_pools_totals_sum_each_engines_spec_counters():
    """Two engines' (a pool's workers) counters add up, per class too; rates from the sums."""
    from lockgate.engine import EngineStats, SpecClassStats, SpecStats
    from lockgate.engine.stats import summed_stats

    def one(drafts, tokens, kept, per_pos, enabled):
        row = SpecClassStats(enabled, drafts, tokens, kept, per_pos)
        return EngineStats(spec=SpecStats("ngram", 2, 1, 3, True, drafts, tokens, kept, list(per_pos),
                                          {"online": row}))

    total = summed_stats([one(3, 6, 4, [3, 1], False), one(2, 4, 1, [1, 0], True), EngineStats()]).spec
    assert (total.num_drafts, total.num_draft_tokens, total.num_accepted_tokens, total.accepted_per_pos) == \
           (5, 10, 5, [4, 1])
    online = total.classes["online"]
    assert (online.num_drafts, online.accepted_per_pos, online.acceptance_rate, online.enabled) == \
           (5, [4, 1], 0.5, True)
    assert summed_stats([EngineStats()]).spec is None


def test_keeping_a_draft_that_equals_the_sampled_token_is_rejection_samplings_law():
    """For a one-hot draft (the n-gram proposer's), keeping draft token x exactly when the
    token drawn at its position (the sampler's Gumbel-max draw from p) equals x keeps it with
    probability p(x) and emits a token distributed as p, as `rejection_sample(draft_probs=None)`
    does: 200,000 draws of each, the same frequencies within 0.01."""
    from lockgate.engine.spec.verify import rejection_sample

    g = torch.Generator().manual_seed(0)
    p = torch.tensor([0.05, 0.3, 0.1, 0.25, 0.02, 0.08, 0.15, 0.05])
    n, x = 200_000, 3
    drawn = (p / torch.empty(n, len(p)).exponential_(generator=g)).argmax(dim=1)     # the sampler's way
    target = p.expand(n, 2, len(p)).contiguous()
    accepted, tokens = rejection_sample(
        target, None, torch.full((n, 1), x), torch.ones(n, dtype=torch.long), torch.rand(n, 1, generator=g),
        torch.empty(n, 2, len(p)).exponential_(generator=g))
    assert abs((drawn == x).float().mean().item() - p[x].item()) < 0.01
    assert abs(accepted.float().mean().item() - p[x].item()) < 0.01
    for emitted in (drawn, tokens[:, 0]):
        freq = torch.bincount(emitted, minlength=len(p)).float() / n
        assert torch.allclose(freq, p, atol=0.01), freq
