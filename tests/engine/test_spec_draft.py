"""Speculative decoding with a draft model (engine/spec/draft_model.py) on the copy demo model
and its draft (greedy output equal to plain decoding at batch 1, 8 and 32 with most drafts
kept: tests/engine/test_spec_matrix.py): a model switch in a pool; the draft's memory counted;
a mismatched draft refused by name; seeded sampling reproducible; and sampled rows keeping
the target's law (many seeded requests against the exact distribution)."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from lockgate.engine import LLM, SamplingParams, write_copy_model
from lockgate.engine.config import EngineConfig
from lockgate.engine.model_pool import ModelPool
from lockgate.engine.request import EngineRequest
from tests.engine.test_spec_decode import quoting_prompts, run, token_ids
from tests.support.helpers import copy_model, demo_model, random_prompts

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def models() -> tuple[str, str]:
    return copy_model(), copy_model(draft=True)


def draft_spec(draft: str, k: int = 4) -> dict:
    return {"model": draft, "num_speculative_tokens": k}


def test_the_drafts_weights_and_kv_are_in_the_budget(models):
    target, draft = models
    plain = LLM(target, kv_cache_memory=1 << 20).engine
    spec = LLM(target, kv_cache_memory=1 << 20, speculative_config=draft_spec(draft)).engine
    runner = spec.runner
    assert runner.draft is not None
    assert runner.weight_bytes == plain.runner.weight_bytes + runner.draft.weight_bytes
    per_block = plain.runner.bytes_per_block(16) + runner.draft.bytes_per_block(16)
    assert runner.bytes_per_block(16) == per_block
    assert spec.num_kv_blocks == (1 << 20) // per_block < plain.num_kv_blocks
    assert spec.memory is not None and spec.memory.reserved["weights"] == runner.weight_bytes


def test_a_pool_switching_models_keeps_the_output(models):
    """The copy model with its draft and a random demo model on a budget that holds one at a
    time: both offloaded and reloaded (the draft with its target), outputs as without drafts."""
    target, draft = models
    other = demo_model("qwen2", "tiny", 1)
    prompts = {"copy": quoting_prompts(target, 4), "b": random_prompts(other, [9, 23, 31, 17], seed=3)}
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    want = {m: token_ids(run(d, prompts[m], params, None, num_kv_blocks=32)[0]) for m, d in
            (("copy", target), ("b", other))}
    cfg = {"model": target, "served_model_name": "copy", "models": {"b": other}, "dtype": "float32",
           "num_kv_blocks": 32, "speculative_config": draft_spec(draft), "max_num_seqs": 2}
    probe = ModelPool(EngineConfig(**cfg))
    sizes = {n: s.memory_bytes for n, s in probe.stats().pool.models.items()}
    assert probe.cores["copy"].runner.draft is not None and probe.cores["b"].runner.draft is None
    pool = ModelPool(EngineConfig(**cfg, memory_budget=max(sizes.values()) + min(sizes.values()) // 2))
    done: dict[str, list[int]] = {}
    for i in range(4):
        for m in ("copy", "b"):
            pool.add_request(EngineRequest(f"{m}{i}", prompts[m][i], params, model=m))
        for _ in range(4):
            done.update({o.request_id: list(o.outputs[0].token_ids) for o in pool.step() if o.finished})
    while pool.has_unfinished:
        done.update({o.request_id: list(o.outputs[0].token_ids) for o in pool.step() if o.finished})
        assert pool.memory.used_bytes <= pool.memory.total_bytes
    for m in ("copy", "b"):
        assert [done[f"{m}{i}"] for i in range(4)] == [w[0] for w in want[m]], m
    st = pool.stats()
    assert st.pool.models["copy"].loads >= 2 and st.pool.models["copy"].offloads >= 1, st.pool.models
    spec = pool.cores["copy"].stats().spec
    assert spec is not None and spec.num_accepted_tokens > 0


def test_bad_draft_models_are_refused_by_name(models, tmp_path):
    target, _ = models
    small = write_copy_model(tmp_path / "small-draft", draft=True, size="small")
    with pytest.raises(ValueError, match=r"speculative_config\.model: .*vocab_size 8192 .*target's 512"):
        EngineConfig(model=target, speculative_config=draft_spec(str(small)))
    with pytest.raises(ValueError, match=r"speculative_config\.model: .* is not a directory"):
        EngineConfig(model=target, speculative_config=draft_spec(str(tmp_path / "nowhere")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"speculative_config\.model: .* has no config\.json"):
        EngineConfig(model=target, speculative_config=draft_spec(str(tmp_path / "empty")))
    with pytest.raises(ValueError, match=r"speculative_config\.model: the ngram method takes no model"):
        EngineConfig(model=target, speculative_config={"method": "ngram", "model": target,
                                                       "num_speculative_tokens": 2})


def test_seeded_sampling_is_reproducible(models):
    target, draft = models
    prompts = quoting_prompts(target, 6)
    params = [SamplingParams(temperature=0.7, top_p=0.95, max_tokens=40, ignore_eos=True, seed=s)
              for s in range(6)]
    first, stats = run(target, prompts, params, draft_spec(draft), max_num_batched_tokens=64)
    again, _ = run(target, prompts, params, draft_spec(draft), max_num_batched_tokens=64)
    assert token_ids(first) == token_ids(again)
    s = stats.spec
    assert s is not None and s.num_accepted_tokens > s.num_draft_tokens / 2, s


NUM_SEEDS = 1600
TEMPERATURE = 2.0     # the copy models' logits are sharp (a copied token at 30): spread them
TOP_K = 8


def _top_k(outs, at: int, temperature: float) -> list[dict[int, float]]:
    """Per request, the distribution of its token `at` under top_k TOP_K and `temperature`,
    from the raw logprobs of the top TOP_K."""
    dists = []
    for o in outs:
        lps = o.outputs[0].logprobs[at]
        z = sum(math.exp(lp.logprob / temperature) for lp in lps.values())
        dists.append({t: math.exp(lp.logprob / temperature) / z for t, lp in lps.items()})
    return dists


def _tv(a: Counter, b: Counter) -> float:
    total_a, total_b = sum(a.values()), sum(b.values())
    return 0.5 * sum(abs(a[t] / total_a - b[t] / total_b) for t in set(a) | set(b))


@pytest.mark.parametrize("roles", ["copy target, its draft", "swapped"])
def test_sampled_rows_keep_the_targets_law(models, roles):
    """A 2-token prompt, NUM_SEEDS seeded requests (top_k TOP_K, a temperature high enough
    that the copied token does not take all the mass): token 1 is sampled at prefill, token 2 by
    the verifier against the draft's q (one draft token). Given token 1, the exact p (target)
    and q (draft) are read from each model's logprobs. Token 2's histogram matches p's mixture
    and not q's, and the share of drafts kept matches rejection sampling's sum_x min(p, q).
    Swapped (the draft model verifies the copy model's drafts: any two models over one
    vocabulary), q exceeds p on the token both copy, so keeping every draft the target could
    emit would keep more: the check has teeth."""
    target, draft = models if roles != "swapped" else models[::-1]
    prompt = [100, 200]
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=3, ignore_eos=True, seed=s,
                             logprobs=0)
              for s in range(NUM_SEEDS)]
    spec, stats = run(target, [prompt] * NUM_SEEDS, params, draft_spec(draft, k=1), max_num_seqs=NUM_SEEDS,
                      max_num_batched_tokens=4096)
    s = stats.spec
    assert s is not None and s.num_drafts == s.num_draft_tokens == NUM_SEEDS
    firsts = [o.outputs[0].token_ids[0] for o in spec]
    observed = Counter(o.outputs[0].token_ids[1] for o in spec)
    lp = SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, max_tokens=1, logprobs=TOP_K, seed=0)
    ts = sorted(set(firsts))
    p_outs, q_outs = (run(m, [[*prompt, t] for t in ts], lp, None)[0] for m in (target, draft))
    p, q = (dict(zip(ts, _top_k(outs, 0, TEMPERATURE), strict=True)) for outs in (p_outs, q_outs))
    # each emitted token's logprob is the target's own, also where the verifier replaced the sampler's draw
    raw = {t: {tok: v.logprob for tok, v in o.outputs[0].logprobs[0].items()} for t, o in zip(ts, p_outs, strict=True)}
    for o in spec:
        t1, t2 = o.outputs[0].token_ids[:2]
        assert o.outputs[0].logprobs[1][t2].logprob == pytest.approx(raw[t1][t2], abs=1e-4)
    exact, drafted = Counter(), Counter()
    for t in firsts:
        exact.update(p[t])
        drafted.update(q[t])
    keep = sum(sum(min(pr, q[t].get(tok, 0.0)) for tok, pr in p[t].items()) for t in firsts) / NUM_SEEDS
    keep_if_possible = sum(sum(pr for tok, pr in q[t].items() if tok in p[t]) for t in firsts) / NUM_SEEDS
    tol = 0.05      # several times the TV distance's noise at NUM_SEEDS draws over a few dozen tokens
    assert _tv(observed, exact) < tol, (observed, exact)
    assert _tv(exact, drafted) > 2 * tol
    kept = s.num_accepted_tokens / NUM_SEEDS
    sd = math.sqrt(keep * (1 - keep) / NUM_SEEDS)
    assert abs(kept - keep) < 4 * sd, (kept, keep)
    if roles == "swapped":
        assert keep_if_possible - keep > 8 * sd
    print(f"\nTV(observed, target) {_tv(observed, exact):.3f}; TV(target, draft) {_tv(exact, drafted):.3f}; "
          f"kept {kept:.3f}, expected {keep:.3f} (every possible draft: {keep_if_possible:.3f})")


def test_both_proposers_at_two_ranks_equal_plain_decoding(models):
    """Tensor parallelism: the target split over two ranks verifies; the draft model runs
    whole on rank 0 beside its shard (its own KV on the same block tables)."""
    target, draft = models
    prompts = [{"prompt_token_ids": p} for p in quoting_prompts(target, 6)]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = {}
    for name, spec in (("plain", None), ("draft", draft_spec(draft)),
                       ("ngram", {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})):
        llm = LLM(target, max_num_seqs=4, tensor_parallel_size=1 if spec is None else 2, speculative_config=spec)
        try:
            outs[name] = token_ids(llm.generate(prompts, params, use_progress_bar=False))
            st = llm.engine.stats()
        finally:
            llm.engine.shutdown()
        if spec is not None:
            assert st.parallel is not None and st.parallel.tensor_parallel_size == 2
            assert st.spec is not None and st.spec.num_accepted_tokens > st.spec.num_draft_tokens / 2, st.spec
    assert outs["draft"] == outs["plain"] and outs["ngram"] == outs["plain"]
