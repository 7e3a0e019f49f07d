"""Sampling: seeded draws independent of the batch, filters, penalties, logprobs, n > 1,
stop conditions."""

from __future__ import annotations

import math

import pytest
import torch

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.sampler import Sampler, SampleRow
from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, random_prompts


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_model("llama"))


def prompts_of(n, seed=11, lens=(5, 40, 77, 120, 9, 200, 33, 64)):
    return random_prompts(demo_model("llama"), list(lens)[:n], seed=seed)


def gen(llm, prompts, params):
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)


def test_seeded_sampling_is_the_same_alone_and_in_a_full_batch(llm):
    prompts = prompts_of(8)
    params = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=1000 + i) for i in range(8)]
    alone = [gen(llm, [p], sp)[0].outputs[0].token_ids for p, sp in zip(prompts, params, strict=True)]
    # the same requests among unseeded and greedy neighbours, in another order
    noise = random_prompts(demo_model("llama"), [50, 3, 90, 17], seed=99)
    mixed_prompts = noise[:2] + prompts[::-1] + noise[2:]
    mixed_params = ([SamplingParams(max_tokens=30, temperature=1.0)] * 2 + params[::-1]
                    + [SamplingParams(max_tokens=25, temperature=0.0)] * 2)
    outs = gen(llm, mixed_prompts, mixed_params)
    batched = [o.outputs[0].token_ids for o in outs[2:10]][::-1]
    assert batched == alone
    # and different seeds give different tokens on most prompts
    other = gen(llm, prompts, [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.95, seed=7 + i)
                               for i in range(8)])
    differ = sum(o.outputs[0].token_ids != a for o, a in zip(other, alone, strict=True))
    assert differ >= 6
    assert_all_blocks_free(llm.engine)


def test_top_k_one_is_greedy_and_temperature_zero_matches_hf(llm):
    d = demo_model("llama")
    prompts = prompts_of(4)
    outs = gen(llm, prompts, SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3))
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(d, p, 12) for p in prompts]


def test_n_samples_share_prompt_and_differ(llm):
    prompt = prompts_of(1, lens=(70,))[0]
    out = gen(llm, [prompt], SamplingParams(n=4, max_tokens=15, temperature=1.0, seed=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) >= 3
    assert all(len(c.token_ids) == 15 and c.finish_reason == "length" for c in out.outputs)
    # the same seeded request again gives the same four samples
    again = gen(llm, [prompt], SamplingParams(n=4, max_tokens=15, temperature=1.0, seed=5))[0]
    assert [c.token_ids for c in again.outputs] == [c.token_ids for c in out.outputs]
    assert_all_blocks_free(llm.engine)


def test_logprobs_agree_with_the_model(llm):
    d = demo_model("llama")
    prompt = prompts_of(1, lens=(30,))[0]
    out = gen(llm, [prompt], SamplingParams(max_tokens=5, temperature=0.0, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 5
    from tests.support.helpers import hf_model

    with torch.inference_mode():
        ids = torch.tensor([prompt + out.token_ids])
        ref = torch.log_softmax(hf_model(d)(ids).logits[0].float(), dim=-1)
    total = 0.0
    for i, (tok, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        row = ref[len(prompt) - 1 + i]
        assert entry[tok].rank == 1
        assert math.isclose(entry[tok].logprob, row[tok].item(), abs_tol=1e-4)
        assert len(entry) == 3 and next(iter(entry)) == tok      # greedy: chosen is the top-1
        total += entry[tok].logprob
    assert math.isclose(out.cumulative_logprob, total, abs_tol=1e-4)


def test_stop_strings_and_stop_token_ids(llm):
    prompt = prompts_of(1, lens=(25,))[0]
    base = gen(llm, [prompt], SamplingParams(max_tokens=30, temperature=0.0))[0].outputs[0]
    assert len(base.text) > 12
    stop = base.text[8:11]
    cut = base.text.find(stop)
    out = gen(llm, [prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=[stop, "\x00never"]))[0].outputs[0]
    assert out.text == base.text[:cut] and out.finish_reason == "stop" and out.stop_reason == stop
    kept = gen(llm, [prompt], SamplingParams(max_tokens=30, temperature=0.0, stop=stop,
                                             include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == base.text[: cut + len(stop)]
    stop_id = base.token_ids[4]
    first = base.token_ids.index(stop_id)
    out = gen(llm, [prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == base.token_ids[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_id
    assert_all_blocks_free(llm.engine)


def test_eos_stops_unless_ignored(llm):
    """The demo model rarely emits its EOS, so make one of its greedy tokens an EOS id: the
    sequence stops at its first occurrence (the EOS kept in token_ids, as HF does), unless
    ignore_eos."""
    eos = sorted(llm.engine.eos_token_ids)
    assert eos, "demo model declares eos ids"
    prompt = prompts_of(1, lens=(12,))[0]
    base = gen(llm, [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
    llm.engine.eos_token_ids.add(base.token_ids[2])
    try:
        out = gen(llm, [prompt], SamplingParams(max_tokens=10, temperature=0.0))[0].outputs[0]
        first = base.token_ids.index(base.token_ids[2])
        assert out.finish_reason == "stop" and out.token_ids == base.token_ids[: first + 1]
        out = gen(llm, [prompt], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].outputs[0]
        assert out.finish_reason == "length" and out.token_ids == base.token_ids
    finally:
        llm.engine.eos_token_ids.discard(base.token_ids[2])
        llm.engine.eos_token_ids.update(eos)


def row(**kw):
    return SampleRow(SamplingParams(**kw), [1, 2], [2, 3, 3], 0, 10)


def test_sampler_filters_and_penalties():
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, -1.0]])
    # top_k=2 keeps tokens 3 and 2; top_p=0.5 keeps token 3 only (p=0.64); min_p=0.5 keeps 3 and 2? p2/p3 = e^-1 < .5
    for kw, allowed in [({"top_k": 2}, {2, 3}), ({"top_p": 0.5}, {3}), ({"min_p": 0.5}, {3}),
                        ({"min_p": 0.3}, {2, 3})]:
        seen = {sampler(logits, [row(temperature=1.0, seed=s, **kw)]).token_ids[0] for s in range(200)}
        assert seen == allowed, kw
    # repetition penalty (HF rule) over prompt+output tokens {1, 2, 3}; penalties over output
    p = torch.tensor([0.0, 1.0, 2.0, 3.0, -1.0])
    from lockgate.engine.sampler import _apply_penalties

    x = p.clone()
    _apply_penalties(x, row(repetition_penalty=2.0))
    assert x.tolist() == [0.0, 0.5, 1.0, 1.5, -1.0]
    x = p.clone()
    _apply_penalties(x, row(presence_penalty=0.5, frequency_penalty=0.25))
    # output [2, 3, 3]: token 2 -> 2 - .25 - .5; token 3 -> 3 - .5 - .5
    assert x.tolist() == [0.0, 1.0, 1.25, 2.0, -1.0]


def test_min_tokens_holds_off_stop_tokens(llm):
    prompt = prompts_of(1, lens=(12,))[0]
    base = gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0.0))[0].outputs[0]
    stop_id = base.token_ids[0]
    out = gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id]))[0].outputs[0]
    assert out.token_ids == [stop_id]
    later = [i for i, t in enumerate(base.token_ids) if t == stop_id and i >= 4]
    out = gen(llm, [prompt], SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id],
                                            min_tokens=4))[0].outputs[0]
    assert out.token_ids == base.token_ids[: later[0] + 1] if later else base.token_ids


def test_output_text_is_decoded_in_the_prompts_context(llm):
    tok = llm.tokenizer
    prompt = "The naïve café served 日本 tea"
    res = llm.generate(prompt, SamplingParams(max_tokens=20, temperature=0.0), use_progress_bar=False)
    out = res[0].outputs[0]
    ids = tok.encode(prompt)
    assert res[0].prompt_token_ids == ids and res[0].prompt == prompt
    full = tok.decode(ids + out.token_ids)
    assert full.startswith(tok.decode(ids))
    # a random model may emit byte tokens that never form a valid character: a full decode
    # shows those as U+FFFD, the stream holds them back; everything else agrees
    assert out.text.replace("\ufffd", "") == full[len(tok.decode(ids)):].replace("\ufffd", "")


def test_sampler_logit_bias_forces_and_bans():
    """The bias is added to the logit (vLLM's rule): +100 forces a token whose logit is within
    100 of the best, greedy or sampled; -100 bans the best one."""
    sampler = Sampler(0, torch.device("cpu"))
    logits = torch.tensor([[0.0, 1.0, 2.0, 30.0, -40.0]])
    for temperature in (0.0, 1.0):
        seen = {sampler(logits, [row(temperature=temperature, seed=s, logit_bias={4: 100})]).token_ids[0]
                for s in range(50)}
        assert seen == {4}, temperature
    assert sampler(logits, [row(temperature=0.0, logit_bias={3: -100})]).token_ids == [2]
    # a row without a bias in the same batch is untouched
    out = sampler(logits.repeat(2, 1), [row(temperature=0.0, logit_bias={4: 100}), row(temperature=0.0)])
    assert out.token_ids == [4, 3]


def test_logit_bias_forces_a_token_through_the_engine(llm):
    """Through the engine: +100 on the model's fifth choice makes it the token, greedy or
    sampled; the logprobs stay the model's own; a token outside the vocabulary is refused.
    (The demo model's random weights spread its logits wider than 100, so the forced token is
    one the model ranks near the top: +100 then leaves no doubt.)"""
    prompt = prompts_of(1, lens=(30,))[0]
    base = gen(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=5))[0].outputs[0]
    fifth = next(t for t, lp in base.logprobs[0].items() if lp.rank == 5)
    for sp in (SamplingParams(max_tokens=1, temperature=0.0, logprobs=0, logit_bias={fifth: 100}),
               SamplingParams(max_tokens=1, temperature=1.0, seed=4, logprobs=0, logit_bias={fifth: 100.0})):
        out = gen(llm, [prompt], sp)[0].outputs[0]
        assert out.token_ids == [fifth]
        assert out.logprobs[0][fifth].rank == 5
    banned = gen(llm, [prompt], SamplingParams(max_tokens=1, temperature=0.0,
                                               logit_bias={base.token_ids[0]: -100}))[0].outputs[0]
    assert banned.token_ids[0] != base.token_ids[0]
    with pytest.raises(ValueError, match=r"^logit_bias\b"):
        gen(llm, [prompt], SamplingParams(logit_bias={10**6: 1.0}))
