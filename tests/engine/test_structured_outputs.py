"""Structured outputs in the engine: grammars compiled off the step loop, masks applied per
row inside the batched sampler, the matcher advanced by every sampled token, and the
sequence ended ("stop") when the grammar is complete. The demo models are random weights,
so their free output is noise: every constrained output that stops must still parse and
validate, and a bounded schema must be finished within max_tokens almost always."""

from __future__ import annotations

import asyncio
import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from lockgate.engine import LLM, AsyncEngine, GrammarError, SamplingParams, StructuredOutputsParams, grammar_compiler
from lockgate.engine.config import EngineConfig, ModelConfig
from lockgate.engine.engine_core import EngineCore
from lockgate.engine.grammar import allowed_tokens, grammar_bitmask, mask_logits
from lockgate.engine.request import EngineRequest, SeqStatus
from tests.support.helpers import assert_all_blocks_free, demo_model, hf_greedy, hf_model, random_prompts

POINT = {"type": "object", "additionalProperties": False, "required": ["x", "y"],
         "properties": {"x": {"type": "integer", "minimum": -10, "maximum": 10},
                        "y": {"type": "integer", "minimum": -10, "maximum": 10}}}

# bounded schemas: enums, string lengths, integer ranges, array lengths, no extra properties
SCHEMAS = {
    "flat": {"type": "object", "additionalProperties": False, "required": ["name", "age", "active"],
             "properties": {"name": {"type": "string", "maxLength": 8},
                            "age": {"type": "integer", "minimum": 0, "maximum": 120},
                            "active": {"type": "boolean"}}},
    "nested": {"type": "object", "additionalProperties": False, "required": ["user", "meta"],
               "properties": {
                   "user": {"type": "object", "additionalProperties": False, "required": ["id", "role"],
                            "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "role": {"enum": ["admin", "user", "guest"]}}},
                   "meta": {"type": "object", "additionalProperties": False, "required": ["score", "ok"],
                            "properties": {"score": {"type": "integer", "minimum": -5, "maximum": 5},
                                           "ok": {"type": "boolean"}}}}},
    "arrays": {"type": "object", "additionalProperties": False, "required": ["tags", "ids"],
               "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 4},
                              "ids": {"type": "array", "minItems": 1, "maxItems": 3,
                                      "items": {"type": "integer", "minimum": 0, "maximum": 99}}}},
    "optional": {"type": "object", "additionalProperties": False, "required": ["code"],
                 "properties": {"code": {"type": "string", "maxLength": 4},
                                "level": {"type": "integer", "minimum": 0, "maximum": 9},
                                "color": {"enum": ["red", "green"]}}},
    "refs": {"$defs": {"Point": POINT}, "type": "object", "additionalProperties": False,
             "required": ["origin", "path"],
             "properties": {"origin": {"$ref": "#/$defs/Point"},
                            "path": {"type": "array", "items": {"$ref": "#/$defs/Point"}, "maxItems": 3}}},
    "any_of": {"type": "object", "additionalProperties": False, "required": ["value", "unit"],
               "properties": {"value": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                                  {"type": "string", "maxLength": 3}, {"type": "null"}]},
                              "unit": {"const": "kg"}}},
}
NUM_RUNS = 16
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
MAX_TOKENS = 96


@pytest.fixture(scope="module")
def llm():
    return LLM(demo_model("llama"))


def _eos(model_dir: str) -> list[int]:
    return ModelConfig.from_dir(model_dir).eos_token_ids


def test_bounded_schemas_validate_and_finish(llm):
    """Every schema, 16 prompts each (temperature 1, seeded), all in one batch with free
    requests: each output that stops parses and validates, and at least 90% stop."""
    d = demo_model("llama")
    prompts = random_prompts(d, [3 + 5 * i for i in range(NUM_RUNS)], seed=11)
    requests, params = [], []
    for name, schema in SCHEMAS.items():
        spec = StructuredOutputsParams(json=schema)
        for i in range(len(prompts)):
            requests.append((name, schema))
            params.append(SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=i, structured_outputs=spec))
    free = random_prompts(d, [9, 30, 61], seed=12)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts * len(SCHEMAS) + free],
                        params + [SamplingParams(max_tokens=20, temperature=0.0)] * len(free),
                        use_progress_bar=False)
    stops: dict[str, int] = dict.fromkeys(SCHEMAS, 0)
    texts: dict[str, set[str]] = {name: set() for name in SCHEMAS}
    for (name, schema), out in zip(requests, outs, strict=False):
        c = out.outputs[0]
        texts[name].add(c.text)
        assert c.finish_reason in ("stop", "length")
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
            stops[name] += 1
        assert not re.search(r"\s", _STRING.sub('""', c.text)), f"compact JSON, no whitespace: {c.text!r}"
    print("stop rate per schema:", {k: f"{v}/{NUM_RUNS}" for k, v in stops.items()})
    for name, n in stops.items():
        assert n >= 0.9 * NUM_RUNS, f"{name}: only {n}/{NUM_RUNS} finished within {MAX_TOKENS} tokens"
        assert len(texts[name]) >= NUM_RUNS // 4, f"{name}: the outputs hardly differ"
    for p, out in zip(free, outs[-len(free):], strict=True):
        assert out.outputs[0].token_ids == hf_greedy(d, p, 20)
    assert_all_blocks_free(llm.engine)


def hf_constrained_greedy(model_dir: str, prompt: list[int], spec: StructuredOutputsParams,
                          max_tokens: int) -> list[int]:
    """The oracle: HF transformers' logits, the grammar's allowed tokens from llguidance's
    own byte mask (not the engine's bitmask unpacking), argmax, one token at a time."""
    cfg = ModelConfig.from_dir(model_dir)
    matcher = grammar_compiler(model_dir, cfg.vocab_size, cfg.eos_token_ids).compile(spec).result().new_matcher()
    model = hf_model(model_dir)
    ids, out = list(prompt), []
    with torch.inference_mode():
        for _ in range(max_tokens):
            logits = model(torch.tensor([ids])).logits[0, -1].clone()
            allowed = torch.frombuffer(bytearray(matcher.compute_logit_bias()), dtype=torch.uint8)[: cfg.vocab_size] > 0
            logits[~allowed] = float("-inf")
            token = int(logits.argmax())
            out.append(token)
            if token in cfg.eos_token_ids:
                break
            assert matcher.consume_token(token)
            if matcher.is_stopped():
                break
            ids.append(token)
    return out


@pytest.mark.parametrize("overlap", [False, True], ids=["masks-in-sampler", "masks-during-forward"])
def test_constrained_greedy_matches_masked_hf_and_free_rows_are_unchanged(llm, overlap):
    """Greedy rows, half constrained, in one batch: the constrained ones equal HF's argmax
    under the grammar's mask, the free ones equal HF's plain greedy output. Masks computed
    by the sampler (the CPU's way) or on a thread during the forward (an accelerator's)."""
    d = demo_model("llama")
    llm.engine.runner.overlap_masks = overlap
    prompts = random_prompts(d, [4, 17, 33, 50, 8, 21], seed=13)
    spec = StructuredOutputsParams(json=SCHEMAS["nested"])
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=spec if i % 2 == 0 else None)
              for i in range(len(prompts))]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_progress_bar=False)
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        got = out.outputs[0].token_ids
        if i % 2 == 0:
            assert got == hf_constrained_greedy(d, p, spec, 40)
        else:
            assert got == hf_greedy(d, p, 40)
    if overlap:
        assert llm.engine.runner._mask_pool is not None     # the thread did compute them
    llm.engine.runner.overlap_masks = False
    assert_all_blocks_free(llm.engine)


@pytest.mark.parametrize("spec, check", [
    (StructuredOutputsParams(regex=r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutputsParams(choice=["alpha", "beta", "gamma delta"]), lambda t: t in ("alpha", "beta", "gamma delta")),
])
def test_regex_and_choice_end_when_complete(llm, spec, check):
    """A grammar that allows nothing more ends the sequence at once ("stop", no EOS token)."""
    d = demo_model("llama")
    prompts = random_prompts(d, [5, 12, 40, 7, 26, 3], seed=14)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=30, temperature=1.0, seed=3, structured_outputs=spec),
                        use_progress_bar=False)
    for out in outs:
        c = out.outputs[0]
        assert c.finish_reason == "stop" and check(c.text), c.text
        if spec.choice is not None:
            assert c.token_ids[-1] not in _eos(d)


def test_preempted_constrained_sequences_resume_their_grammar():
    """A cache too small for the batch: constrained sequences are preempted and recomputed,
    their grammar state kept; every finished output still validates."""
    d = demo_model("llama")
    llm = LLM(d, num_kv_blocks=12)
    schema = SCHEMAS["arrays"]
    prompts = random_prompts(d, [60, 50, 45, 70, 40, 55], seed=15)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(max_tokens=60, temperature=1.0, seed=5,
                                       structured_outputs=StructuredOutputsParams(json=schema)),
                        use_progress_bar=False)
    assert llm.engine.scheduler.num_preemptions > 0
    for out in outs:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs) >= 5
    assert_all_blocks_free(llm.engine)


def test_eos_is_allowed_only_where_the_grammar_is_complete():
    d = demo_model("llama")
    cfg = ModelConfig.from_dir(d)
    compiler = grammar_compiler(d, cfg.vocab_size, cfg.eos_token_ids)
    matcher = compiler.compile(StructuredOutputsParams(json={"type": "integer", "minimum": 0, "maximum": 500})
                               ).result().new_matcher()
    tok = compiler.tokenizer()

    def allowed() -> torch.Tensor:
        return allowed_tokens(grammar_bitmask([matcher], cfg.vocab_size), cfg.vocab_size)[0]

    assert not allowed()[cfg.eos_token_ids].any()          # nothing yet: no end
    assert matcher.consume_tokens(tok.tokenize_str("1"))
    assert allowed()[cfg.eos_token_ids].all()              # "1" is complete, "10" could follow
    assert matcher.consume_tokens(tok.tokenize_str("00"))
    assert matcher.is_stopped()                            # "100" and no digit may follow


@pytest.mark.parametrize("vocab_size", [1, 31, 32, 33, 100, 517])
def test_bitmask_unpacking_matches_a_bit_loop(vocab_size):
    """Token t is bit t % 32 of word t // 32 (negative words included), rows masked alone."""
    g = torch.Generator().manual_seed(vocab_size)
    words = (vocab_size + 31) // 32
    bitmask = torch.randint(-(2**31), 2**31 - 1, (3, words), generator=g, dtype=torch.int64).to(torch.int32)
    got = allowed_tokens(bitmask, vocab_size)
    want = torch.tensor([[(int(bitmask[r, t // 32]) >> (t % 32)) & 1 == 1 for t in range(vocab_size)]
                         for r in range(3)])
    assert torch.equal(got, want)


def test_mask_logits_touches_only_constrained_rows():
    d = demo_model("llama")
    cfg = ModelConfig.from_dir(d)
    compiler = grammar_compiler(d, cfg.vocab_size, cfg.eos_token_ids)
    matcher = compiler.compile(StructuredOutputsParams(choice=["yes", "no"])).result().new_matcher()
    logits = torch.randn(3, cfg.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    mask_logits(logits, [1], grammar_bitmask([matcher], cfg.vocab_size))
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    kept = torch.isfinite(logits[1])
    assert 0 < int(kept.sum()) < 10
    assert torch.equal(logits[1][kept], before[1][kept])
    assert {compiler.tokenizer().decode_str([t]) for t in kept.nonzero().flatten().tolist()} <= {"y", "ye", "yes",
                                                                                                 "n", "no"}


def test_bad_schema_fails_its_request_only():
    """LLM raises the compile error; in AsyncEngine only that request's stream does."""
    d = demo_model("llama")
    bad = SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "strin"}))
    with pytest.raises(GrammarError) as exc:
        LLM(d).generate("hello", bad, use_progress_bar=False)
    assert exc.value.field == "structured_outputs.json" and "strin" in str(exc.value)

    async def main():
        async with AsyncEngine(d) as engine:
            async def run(params, rid):
                return [o async for o in engine.generate([5, 6, 7], params, rid)][-1]
            good = SamplingParams(max_tokens=5, temperature=0.0)
            results = await asyncio.gather(run(bad, "bad"), run(good, "good"), return_exceptions=True)
            assert isinstance(results[0], GrammarError)
            assert results[1].outputs[0].token_ids == hf_greedy(d, [5, 6, 7], 5)
            assert_all_blocks_free(engine.core)

    asyncio.run(main())


class _HeldCompiler:
    """A compiler whose compile finishes only when the test says so."""

    def __init__(self, real) -> None:
        self.real, self.future = real, Future()

    def compile(self, spec, owner="default"):
        return self.future


def test_request_waits_unscheduled_until_its_grammar_is_compiled():
    d = demo_model("llama")
    core = EngineCore(EngineConfig(model=d))
    held = _HeldCompiler(core.grammars.compiler)
    core.grammars.compiler = held
    spec = StructuredOutputsParams(choice=["on", "off"])
    constrained = core.add_request(EngineRequest("c", [3, 4, 5], SamplingParams(max_tokens=8, structured_outputs=spec)))
    free = core.add_request(EngineRequest("f", [3, 4, 6], SamplingParams(max_tokens=4, temperature=0.0)))
    while not free.finished:
        core.step()                         # the free request runs; the other waits, holding nothing
    assert constrained.first_scheduled_time is None and constrained.seqs[0].status is SeqStatus.WAITING
    assert core.step() == [] and core.kv.num_used_blocks == 0     # nothing to run: the loop idles
    held.future.set_result(held.real.compile(spec).result())
    outs = []
    while core.has_unfinished:
        outs += core.step()
    assert outs[-1].outputs[0].text in ("on", "off") and outs[-1].outputs[0].finish_reason == "stop"
    # a compile that fails fails its request, at the next step
    held.future = Future()
    core.add_request(EngineRequest("x", [3, 4, 5], SamplingParams(structured_outputs=spec)))
    core.step()
    held.future.set_exception(GrammarError("structured_outputs.choice: no", field="structured_outputs.choice"))
    core.step()
    core.step()
    assert [rid for rid, _ in core.failed] == ["x"] and not core.has_unfinished
    assert_all_blocks_free(core)
