"""The fairness scheduler on the real model: outputs still equal HF transformers' with
tenants, classes, priorities and preemption mixed; the prefix cache is salted by tenant."""

from __future__ import annotations

from lockgate.engine import LLM, SamplingParams
from lockgate.engine.request import EngineRequest
from tests.support.helpers import MAX_TOKENS, PROMPT_LENS, demo_model, hf_greedy, random_prompts


def test_mixed_tenants_classes_and_preemption_match_hf():
    """18 requests over 3 tenants (weights 1, 2, 0.5), both classes, mixed priorities, in
    22 blocks of 16 tokens: requests queue, offline work is preempted for online work and
    recomputed. Every output equals HF's greedy continuation."""
    d = demo_model("llama")
    prompts = random_prompts(d, PROMPT_LENS, seed=11)
    llm = LLM(d, num_kv_blocks=22, max_num_batched_tokens=96)
    core = llm.engine
    weights = {"t0": 1.0, "t1": 2.0, "t2": 0.5}
    for i, (p, m) in enumerate(zip(prompts, MAX_TOKENS, strict=True)):
        tenant = f"t{i % 3}"
        core.add_request(EngineRequest(
            f"q{i}", p, SamplingParams(max_tokens=m, temperature=0.0), tenant=tenant,
            tenant_weight=weights[tenant], service_class="offline" if i % 2 else "online",
            priority=(i * 7) % 3 - 1))
    done = {}
    while core.has_unfinished:
        for out in core.step():
            if out.finished:
                done[out.request_id] = out
    got = [done[f"q{i}"].outputs[0].token_ids for i in range(len(prompts))]
    want = [hf_greedy(d, p, m) for p, m in zip(prompts, MAX_TOKENS, strict=True)]
    assert got == want
    stats = core.stats()
    assert stats.num_preemptions > 0
    assert stats.classes["offline"].preemptions > 0
    assert set(stats.tenants) == {"t0", "t1", "t2"}
    assert core.kv.num_used_blocks == 0


def test_prefix_cache_is_per_tenant_unless_shared():
    """A 100-token prompt (6 full blocks of 16): the same tenant's second request hits 96
    tokens; another tenant's gets 0; two tenants of one share group both hit."""
    d = demo_model("llama")
    prompt = random_prompts(d, [100], seed=12)[0]
    llm = LLM(d)
    sp = SamplingParams(max_tokens=2, temperature=0.0)

    def cached(**kw):
        return llm.generate([{"prompt_token_ids": prompt}], sp, use_progress_bar=False, **kw)[0].num_cached_tokens

    assert cached(tenant="acme") == 0
    assert cached(tenant="acme") == 96
    assert cached(tenant="globex") == 0
    assert cached(tenant="acme", cache_salt="other") == 0
    assert cached(tenant="initech", share_group="public-docs") == 0
    assert cached(tenant="umbrella", share_group="public-docs") == 96
    stats = llm.engine.stats()
    assert stats.tenants["acme"]["online"].cached_tokens == 96
    assert stats.tenants["globex"]["online"].cached_tokens == 0
