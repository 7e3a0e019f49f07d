"""Greedy output with speculative decoding equals the output without it, for both proposers
(n-gram prompt lookup, and the copy model's draft model) on the copy demo model, in runs that
hold chunked prefill, prefix caching (a shared opening), preemption (a small cache), a LoRA
adapter and a JSON schema: at batch 1 (8 prompts x 64 tokens, one at a time) and at 8 and 32
(the same 64 prompts x 128 tokens at max_num_seqs 8 and 32). Each speculative run is compared
with one run without speculation; a request may differ only where HF's float64 top-two gap at
its first difference is below 1e-3 (a coin toss for float32 arithmetic), at most 2 a run,
each printed. Rows with an adapter or a grammar must be equal outright (HF's gap there would
not be the base model's).

Cheap by construction: tiny models, torch on one thread, each reference run once per module."""

from __future__ import annotations

import functools

import pytest
import torch

from lockgate.engine import LLM, LoRARequest, SamplingParams, StructuredOutputsParams
from tests.engine.test_spec_decode import quoting_prompts, token_ids
from tests.support.helpers import NEAR_TIE, copy_model, hf_model_f64

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "n": {"type": "integer"}}, "required": ["name", "n"]}
LORA_EVERY, SCHEMA_EVERY = 8, 16        # rows i % 8 == 3 run the adapter, i % 16 == 5 the schema
# batch 1: one at a time, prompts chunked at 48 tokens; 8 and 32: chunks of 256 tokens, and
# 240 blocks of 16 for sequences of ~230 tokens (15 blocks each): preempted at 32
BATCH_1 = {"max_num_seqs": 1, "max_num_batched_tokens": 48, "num_kv_blocks": 64}
BATCH_N = {"max_num_batched_tokens": 256, "num_kv_blocks": 240}
LORA = {"enable_lora": True, "max_loras": 1, "max_lora_rank": 8}


@functools.cache
def adapter(tmp: str) -> LoRARequest:
    from lockgate.engine.lora_demo import write_demo_adapter

    return LoRARequest("qv", 1, str(write_demo_adapter(copy_model(), f"{tmp}/qv", rank=8, targets="q,v", seed=5)))


def workload(num: int, max_tokens: int, lora: LoRARequest):
    prompts = quoting_prompts(copy_model(), num)
    greedy = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    schema = SamplingParams(temperature=0.0, max_tokens=max_tokens,
                            structured_outputs=StructuredOutputsParams(json=SCHEMA))
    params = [schema if i % SCHEMA_EVERY == 5 else greedy for i in range(num)]
    loras = [lora if i % LORA_EVERY == 3 else None for i in range(num)]
    return prompts, params, loras


def generate(spec: dict | None, engine: dict, prompts, params, loras):
    llm = LLM(copy_model(), speculative_config=spec, **LORA, **engine)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, lora_request=loras,
                        use_progress_bar=False)
    return [ids[0] for ids in token_ids(outs)], llm.engine.stats()


def compare(label: str, prompts, plain, spec, exact: list[bool]) -> list[str]:
    """Requests where `spec` differs from `plain`: each allowed only as a near tie of HF's
    float64 base model (and never on an `exact` row), at most 2; the ties, printed."""
    model = hf_model_f64(copy_model())
    ties, decisive = [], []
    for i, (p, a, b) in enumerate(zip(prompts, plain, spec, strict=True)):
        if a == b:
            continue
        t = next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
        line = f"{label} request {i}: first difference at token {t} of {len(a)}/{len(b)}"
        if exact[i] or t >= min(len(a), len(b)):
            decisive.append(line + (" (adapter or schema row)" if exact[i] else " (lengths)"))
            continue
        with torch.inference_mode():
            top = torch.topk(model(torch.tensor([p + a[:t]])).logits[0, -1], 2)
        gap = float(top.values[0] - top.values[1])
        line += f" ({a[t]} without, {b[t]} with), HF float64 top-two gap {gap:.2e}"
        (ties if gap < NEAR_TIE else decisive).append(line)
    for line in ties:
        print("near tie:", line)
    assert not decisive, "speculation changed the output where it is decisive:\n" + "\n".join(decisive)
    assert len(ties) <= 2, f"{len(ties)} near ties, more than 2:\n" + "\n".join(ties)
    return ties


PROPOSERS = {
    "ngram": lambda: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1},
    "draft": lambda: {"model": copy_model(draft=True), "num_speculative_tokens": 4},
}


@pytest.fixture(scope="module")
def lora(tmp_path_factory) -> LoRARequest:
    pytest.importorskip("peft")
    return adapter(str(tmp_path_factory.mktemp("spec-matrix")))


@pytest.fixture(scope="module")
def batch_1(lora):
    work = workload(8, 64, lora)
    return work, *generate(None, BATCH_1, *work)


@pytest.fixture(scope="module")
def batch_n(lora):
    work = workload(64, 128, lora)
    return work, *generate(None, {"max_num_seqs": 32, **BATCH_N}, *work)


@pytest.mark.parametrize("proposer", sorted(PROPOSERS))
def test_batch_1(proposer, batch_1):
    (prompts, params, loras), plain, plain_stats = batch_1
    got, stats = generate(PROPOSERS[proposer](), BATCH_1, prompts, params, loras)
    compare(f"{proposer} batch 1", prompts, plain, got, [lr is not None or p.structured_outputs is not None
                                                         for p, lr in zip(params, loras, strict=True)])
    s = stats.spec
    assert s is not None and s.num_accepted_tokens > s.num_draft_tokens / 2, s
    assert stats.kv.prefix_cache_hits > 0 and stats.num_steps < plain_stats.num_steps / 2


@pytest.mark.parametrize("max_num_seqs", [8, 32])
@pytest.mark.parametrize("proposer", sorted(PROPOSERS))
def test_batch_8_and_32(proposer, max_num_seqs, batch_n):
    (prompts, params, loras), plain, plain_stats = batch_n
    got, stats = generate(PROPOSERS[proposer](), {"max_num_seqs": max_num_seqs, **BATCH_N}, prompts, params, loras)
    compare(f"{proposer} batch {max_num_seqs}", prompts, plain, got,
            [lr is not None or p.structured_outputs is not None for p, lr in zip(params, loras, strict=True)])
    s = stats.spec
    assert s is not None and s.num_accepted_tokens > s.num_draft_tokens / 2, s
    assert stats.kv.prefix_cache_hits > 0 and (stats.num_preemptions > 0 or max_num_seqs == 8)
    # the plain run is at batch 32; at batch 8 the bound is what plain decoding needs at least
    # (one token a row a step): fewer steps than either is speculation paying
    bound = plain_stats.num_steps if max_num_seqs == 32 else len(prompts) * 128 // max_num_seqs
    assert stats.num_steps < bound, (stats.num_steps, bound)
    print(f"\n{proposer} batch {max_num_seqs}: {s.num_accepted_tokens}/{s.num_draft_tokens} kept, "
          f"{stats.num_steps} steps, {stats.num_preemptions} preemptions")


def test_the_comparison_catches_a_changed_token(batch_1):
    """A token changed where the copy model is decisive, or on an adapter row, or a shorter
    output: each refused."""
    (prompts, _, _), plain, _ = batch_1
    changed = [list(plain[0]), *plain[1:]]
    changed[0][10] = (changed[0][10] + 1) % 512
    with pytest.raises(AssertionError, match=r"request 0: first difference at token 10 .* gap"):
        compare("control", prompts, plain, changed, [False] * len(plain))
    with pytest.raises(AssertionError, match="adapter or schema row"):
        compare("control", prompts, plain, changed, [True] * len(plain))
    with pytest.raises(AssertionError, match="lengths"):
        compare("control", prompts, plain, [plain[0][:-1], *plain[1:]], [False] * len(plain))
