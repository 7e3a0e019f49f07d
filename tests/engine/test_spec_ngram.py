"""The n-gram proposer (engine/spec/ngram.py) and `speculative_config`'s checks."""

from __future__ import annotations

import pytest

from lockgate.engine.spec.config import SpeculativeConfig
from lockgate.engine.spec.ngram import propose


def _naive(tokens: list[int], k: int, lo: int, hi: int) -> list[int]:
    """The rule spelled out: the longest suffix in [lo, hi] seen earlier, its latest occurrence."""
    for n in range(min(hi, len(tokens) - 1), lo - 1, -1):
        suffix = tokens[-n:]
        for s in range(len(tokens) - n - 1, -1, -1):
            if tokens[s:s + n] == suffix:
                return tokens[s + n:s + n + k]
    return []


def test_proposes_what_followed_the_latest_earlier_occurrence():
    """... 1 2 3 [7 8 9] ... 1 2 3 [4 5] ... 1 2 3: the latest occurrence of 1 2 3 is followed by 4 5."""
    tokens = [1, 2, 3, 7, 8, 9, 0, 1, 2, 3, 4, 5, 6, 1, 2, 3]
    assert propose(tokens, 2, 1, 3) == [4, 5]
    assert propose(tokens, 5, 1, 3) == [4, 5, 6, 1, 2]


def test_longest_suffix_wins_over_a_later_shorter_one():
    """Suffix 5 6: '5 6' occurs at 0 (then 1), '6' alone later at 4 (then 9): two tokens match first."""
    tokens = [5, 6, 1, 2, 6, 9, 3, 5, 6]
    assert propose(tokens, 1, 1, 2) == [1]
    assert propose(tokens, 1, 1, 1) == [9]


def test_nothing_when_no_suffix_of_the_minimum_length_occurred():
    assert propose([1, 2, 3, 4], 3, 1, 4) == []
    assert propose([1, 2, 1, 3], 3, 2, 4) == []          # '1 3' never seen before
    assert propose([7], 3, 1, 1) == []
    assert propose([1, 2, 1], 0, 1, 2) == []


def test_the_continuation_may_run_into_the_suffix_itself():
    """A repeated token: 4 4 4, suffix 4 4 seen at 0, followed by 4 (then the end)."""
    assert propose([4, 4, 4], 5, 2, 2) == [4]
    assert propose([4, 4, 4, 4], 5, 1, 3) == [4]


def test_ids_across_packing_boundaries_are_not_matched():
    """Ids packed 8 bytes each, little-endian: x's high half and y's low half spell b's bytes,
    a match at byte 4 that is no occurrence of b: nothing proposed from it."""
    b = (3 << 32) | 4
    x, y = (4 << 32) | 7, (9 << 32) | 3
    assert propose([x, y, 5, b], 2, 1, 1) == []
    assert propose([x, y, b, 5, 6, b], 2, 1, 1) == [5, 6]


def test_agrees_with_the_rule_spelled_out_on_random_sequences():
    import random

    rng = random.Random(0)  # noqa: S311 (test data)
    for _ in range(300):
        tokens = [rng.randrange(6) for _ in range(rng.randrange(1, 40))]
        k, lo = rng.randrange(1, 6), rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 3)
        assert propose(tokens, k, lo, hi) == _naive(tokens, k, lo, hi), (tokens, k, lo, hi)


def test_config_defaults_as_vllm_and_errors_name_the_field():
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.of({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (3, 3)
    c = SpeculativeConfig.of({"num_speculative_tokens": 2, "prompt_lookup_min": 2, "prompt_lookup_max": 4})
    assert (c.method, c.prompt_lookup_min, c.prompt_lookup_max) == ("ngram", 2, 4)
    assert SpeculativeConfig.of(None) is None
    bad = [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method"),
        ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": True}, "speculative_config.num_speculative_tokens"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 0}, "speculative_config.prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "prompt_lookup_max": "3"}, "speculative_config.prompt_lookup_max"),
        ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
         "speculative_config.prompt_lookup_min"),
        ({"num_speculative_tokens": 2, "model": "x"}, "unknown field"),
        ([1, 2], "speculative_config: must be a mapping"),
    ]
    for value, needle in bad:
        with pytest.raises(ValueError, match=needle.replace(".", r"\.")):
            SpeculativeConfig.of(value)


def test_engine_config_takes_the_dict_and_checks_it():
    from lockgate.engine import EngineConfig
    from tests.support.helpers import demo_model

    cfg = EngineConfig(demo_model(), speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                         "prompt_lookup_max": 2})
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 2, 2)
    assert EngineConfig(demo_model()).speculative_config is None
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        EngineConfig(demo_model(), speculative_config={"method": "ngram"})
