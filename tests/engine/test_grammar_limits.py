"""Grammar bombs in the engine: a short pattern whose counted repetitions expand to millions
of states is refused where it is compiled (its request fails with GrammarError naming the
field), and the first mask of every grammar is computed off the step, so a constrained or
free request running beside it finishes normally and no mask the step computes goes over
the budget. The compile cache is bounded in bytes and per tenant."""

from __future__ import annotations

import asyncio
from concurrent.futures import Future

import llguidance
import pytest

from lockgate.engine import AsyncEngine, GrammarError, SamplingParams, StructuredOutputsParams, grammar_compiler
from lockgate.engine.config import ModelConfig
from lockgate.engine.grammar import GrammarCompiler
from lockgate.engine.grammar_cache import GrammarCache
from lockgate.engine.grammar_limits import MASK_STATS, MAX_REGEX_EXPANSION, GrammarTooComplex, regex_expansion
from lockgate.loadtests.harness.bombs import BOMB_PATTERNS
from tests.support.helpers import assert_all_blocks_free, demo_model


def _compiler(**kwargs) -> GrammarCompiler:
    d = demo_model("llama")
    mc = ModelConfig.from_dir(d)
    return GrammarCompiler(d + "/tokenizer.json", mc.vocab_size, mc.eos_token_ids, **kwargs)


@pytest.mark.parametrize("pattern", BOMB_PATTERNS)
def test_every_bomb_is_refused_at_compile(pattern):
    with pytest.raises(GrammarError) as exc:
        _compiler().compile(StructuredOutputsParams(regex=pattern), owner="t").result(timeout=30)
    assert exc.value.field == "structured_outputs.regex"


def test_a_bomb_inside_a_schema_pattern_is_refused():
    schema = {"type": "object", "properties": {"a": {"type": "string", "pattern": BOMB_PATTERNS[2]}}}
    with pytest.raises(GrammarError) as exc:
        _compiler().compile(StructuredOutputsParams(json=schema)).result(timeout=30)
    assert exc.value.field == "structured_outputs.json"


@pytest.mark.parametrize("pattern, bound", [
    ("[0-9]{4}-[0-9]{2}-[0-9]{2}", 10), ("(a{2000}){1000}", 2_000_000), (r"\p{L}{3}x", 4),
    ("(ab|c){10}", 30), ("a{5,}", 6), ("[a{]{9}", 9), (r"\{1000\}", 6), ("a{,5}", 5),
])
def test_regex_expansion_is_an_upper_bound_of_the_counted_repetitions(pattern, bound):
    assert regex_expansion(pattern) == bound


def test_a_bomb_fails_only_its_request_and_the_step_never_computes_a_mask_over_budget():
    d = demo_model("llama")
    before = MASK_STATS.snapshot()

    async def main():
        async with AsyncEngine(d) as engine:
            async def run(params, rid):
                return [o async for o in engine.generate([5, 6, 7], params, rid)][-1]
            bomb = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex=BOMB_PATTERNS[1]))
            choice = SamplingParams(max_tokens=8, temperature=0.0,
                                    structured_outputs=StructuredOutputsParams(choice=["yes", "no"]))
            free = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
            results = await asyncio.gather(run(bomb, "bomb"), run(choice, "choice"), run(free, "free"),
                                           return_exceptions=True)
            assert isinstance(results[0], GrammarError) and results[0].field == "structured_outputs.regex"
            assert results[1].outputs[0].text in ("yes", "no") and results[1].outputs[0].finish_reason == "stop"
            assert len(results[2].outputs[0].token_ids) == 6 and results[2].outputs[0].finish_reason == "length"
            assert_all_blocks_free(engine.core)

    asyncio.run(main())
    after = MASK_STATS.snapshot()
    assert after.computed > before.computed            # the choice's masks ran in the step
    assert after.over_budget == before.over_budget    # none of them over the budget
    assert after.first_masks > before.first_masks     # its first mask was computed at compile


def test_the_cache_is_bounded_in_bytes_and_per_tenant():
    """One tenant's distinct grammars evict only its own entries once past its share; the
    other tenant's stay cached."""
    c = _compiler(max_bytes=8 << 20, tenant_share=0.25)
    theirs = [c.compile(StructuredOutputsParams(regex=f"b[0-9]{{{i}}}"), owner="b") for i in range(1, 4)]
    for f in theirs:
        f.result(timeout=30)
    for i in range(1, 200):
        c.compile(StructuredOutputsParams(regex=f"a[0-9]{{{i}}}x"), owner="a").result(timeout=30)
        assert c.bytes_of("a") <= c.max_bytes * c.tenant_share
        assert c.total_bytes <= c.max_bytes
    for i, f in enumerate(theirs, 1):      # still the cached futures: not evicted
        assert c.compile(StructuredOutputsParams(regex=f"b[0-9]{{{i}}}"), owner="b") is f
    assert c.bytes_of("b") > 0 and c.num_entries("a") < 199


def test_process_compiler_is_shared():
    d = demo_model("llama")
    mc = ModelConfig.from_dir(d)
    assert grammar_compiler(d, mc.vocab_size, mc.eos_token_ids) is grammar_compiler(d, mc.vocab_size,
                                                                                   mc.eos_token_ids)


@pytest.mark.parametrize("kind, spec", [
    ("regex", "x{9000}"),                                                      # forces 9k tokens
    ("json", {"type": "array", "items": {"const": 1}, "minItems": 100000}),    # so does this
])
def test_what_passes_the_static_bound_is_refused_by_its_first_mask(kind, spec):
    """Under MAX_REGEX_EXPANSION, yet forcing more tokens than a grammar may: refused where
    it is compiled, from its first mask, computed there."""
    if kind == "regex":
        assert regex_expansion(spec) <= MAX_REGEX_EXPANSION
    before = MASK_STATS.snapshot()
    with pytest.raises(GrammarTooComplex) as exc:
        _compiler().compile(StructuredOutputsParams(**{kind: spec}), owner="t").result(timeout=30)
    assert exc.value.field == f"structured_outputs.{kind}"
    after = MASK_STATS.snapshot()
    assert after.first_masks == before.first_masks + 1 and after.refused == before.refused + 1
    # the cached failure keeps no matcher alive (its lexer is tens of MB) through its traceback
    assert not _matchers_in(exc.value)


def _matchers_in(error: BaseException) -> list[object]:
    found, tb = [], error.__traceback__
    while tb is not None:
        found += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, llguidance.LLMatcher)]
        tb = tb.tb_next
    return found


def test_past_the_whole_cache_the_biggest_owner_loses_its_oldest():
    cache: GrammarCache[int] = GrammarCache(max_bytes=100, max_entries=100, tenant_share=0.5)

    def put(owner: str, i: int) -> None:
        cache.get_or_start((owner, str(i)), Future, owner, 10)

    for i in range(5):
        put("a", i)
    for i in range(3):
        put("b", i)
    for i in range(3):
        put("c", i)                  # 110 bytes: a (the most) loses its oldest
    assert cache.total_bytes == 100 and cache.bytes_of("a") == 40
    assert cache.get_or_start(("a", "0"), Future, "a", 10)[1]          # gone: started again
    assert not any(cache.get_or_start(("b", str(i)), Future, "b", 10)[1] for i in range(3))
    for i in range(6):
        put("a", 10 + i)             # past its share (50): only a's own entries go
    assert cache.bytes_of("a") <= 50 and cache.bytes_of("b") == 30 and cache.bytes_of("c") == 30
