"""What one grammar may cost: where it is compiled, when its first mask is computed, and at
each step. A short pattern can expand to millions of states: `(a{2000}){1000}` is 15 bytes
and forces two million bytes, so neither the spec's size nor the compile time (llguidance
builds its lexer lazily, on the first mask) says what it costs. Three bounds, each cheaper
than the work it prevents:

1. `regex_expansion`: the pattern's counted repetitions unrolled (an upper bound, read from
   its text: nothing is built). A regex, or a `pattern` in a JSON schema, over
   `MAX_REGEX_EXPANSION` is refused before llguidance sees it.
2. llguidance's own limits (`parser_limits`): the lexer's fuel and states bound one
   grammar's memory (about 180 bytes a unit of initial fuel, 1-2 kB a state); the step
   fuel and Earley items bound one mask's work.
3. `probe`: the first mask is computed where the grammar is compiled, on the compile
   thread, never on the step; a grammar whose first mask costs more CPU than
   `FIRST_MASK_BUDGET_S`, that forces more than `MAX_FORCED_TOKENS` tokens, or that fails
   on the tokens it forces is refused. The sequences' matchers are copies made after it,
   so their first mask is the one already computed.

`MASK_STATS` counts the masks the step computes and those over `STEP_MASK_BUDGET_S`
(thread CPU time: what a row costs the step, whatever else the machine runs).
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass
from typing import Any

import llguidance
import torch

from lockgate.engine.errors import GrammarError

# a counted repetition unrolled past this is refused (a date is 10, an e-mail address's
# parts a few hundred; the bombs are millions): what one step's mask may have to expand
MAX_REGEX_EXPANSION = 10_000
# llguidance's fuel, about 50k units a millisecond: bounds a grammar's lexer to ~40 MB
LEXER_FUEL = 200_000
# one mask's work: llguidance's defaults, sized for vocabularies of 100k+ tokens (~14 ms of
# lexer, ~2.5 ms of Earley items)
STEP_LEXER_FUEL = 200_000
STEP_MAX_ITEMS = 50_000
MAX_LEXER_STATES = 32_000       # 1-2 kB each (llguidance's default, 250k, is up to 500 MB)
MAX_GRAMMAR_SIZE = 200_000
# the first mask's CPU time, at compile; a step's mask (per row) over this is counted
FIRST_MASK_BUDGET_S = 0.25
STEP_MASK_BUDGET_S = 0.1
# tokens a grammar may force in a row (a JSON const of ~16 kB): each is a step's work
MAX_FORCED_TOKENS = 4096
PROBE_TOKENS = 256              # of the forced tokens, those consumed on a copy at compile
MAX_ERROR_CHARS = 500
_CAP = 10**15                   # weights stop growing here (nested counts multiply)
_COUNT = re.compile(r"\{(\d*)(,(\d*))?\}")


class GrammarTooComplex(GrammarError):
    """A spec that compiles but would cost more than a grammar may: its expansion, its
    first mask, or the tokens it forces."""


def parser_limits() -> llguidance.LLParserLimits:
    return llguidance.LLParserLimits(
        initial_lexer_fuel=LEXER_FUEL, step_lexer_fuel=STEP_LEXER_FUEL, step_max_items=STEP_MAX_ITEMS,
        max_lexer_states=MAX_LEXER_STATES, max_grammar_size=MAX_GRAMMAR_SIZE, verbose_errors=False)


# -- the static bound ------------------------------------------------------------------------------


def _skip_class(p: str, i: int) -> int:
    """The index after the character class opening at p[i] (nested classes included)."""
    j = i + 1
    if j < len(p) and p[j] == "^":
        j += 1
    if j < len(p) and p[j] == "]":       # a leading ] is a literal
        j += 1
    depth = 1
    while j < len(p) and depth:
        if p[j] == "\\":
            j += 2
            continue
        depth += {"[": 1, "]": -1}.get(p[j], 0)
        j += 1
    return j


def _skip_escape(p: str, i: int) -> int:
    if p[i + 1:i + 2] in ("p", "P", "x", "u", "U") and p[i + 2:i + 3] == "{":
        end = p.find("}", i + 3)
        return len(p) if end < 0 else end + 1
    return i + 2


def _skip_group_flags(p: str, i: int) -> int:
    """After "(": past "?:", "?i:", "?P<name>", "?<name>" (what is not an atom)."""
    if p[i:i + 1] != "?":
        return i
    if p[i + 1:i + 3] == "P<" or p[i + 1:i + 2] == "<":
        end = p.find(">", i)
        return len(p) if end < 0 else end + 1
    j = i + 1
    while j < len(p) and (p[j].isalpha() or p[j] in "-:"):
        j += 1
        if p[j - 1] == ":":
            break
    return j


def regex_expansion(pattern: str) -> int:
    """An upper bound of the atoms `pattern` matches once its counted repetitions are
    unrolled: `x{n,m}` counts m times x (`x{n,}` n + 1), alternatives add up, `*+?` count
    once (a loop, not a copy)."""
    frames: list[list[int]] = [[0, 0, 0]]     # per open group: alternatives so far, this one, last atom
    i, p = 0, pattern
    while i < len(p):
        c, f, w = p[i], frames[-1], 0
        if c == "\\":
            i, w = _skip_escape(p, i), 1
        elif c == "[":
            i, w = _skip_class(p, i), 1
        elif c == "(":
            frames.append([0, 0, 0])
            i = _skip_group_flags(p, i + 1)
            continue
        elif c == ")" and len(frames) > 1:
            done = frames.pop()
            i, f, w = i + 1, frames[-1], min(done[0] + done[1], _CAP)
        elif c == "|":
            f[0], f[1], f[2] = min(f[0] + f[1], _CAP), 0, 0
            i += 1
            continue
        elif c == "{" and (m := _COUNT.match(p, i)) and (m[1] or m[3]):
            lo, hi = int(m[1] or 0), int(m[3]) if m[3] else None
            times = min(hi if hi is not None else (lo + 1 if m[2] else lo), _CAP)
            f[1] = min(f[1] - f[2] + f[2] * times, _CAP)
            f[2] = min(f[2] * times, _CAP)
            i = m.end()
            continue
        elif c in "*+?":
            i += 1
            continue
        else:
            i, w = i + 1, 1
        f[1], f[2] = min(f[1] + w, _CAP), w
    while len(frames) > 1:                    # unbalanced: llguidance refuses it, still bounded here
        done = frames.pop()
        frames[-1][1] = min(frames[-1][1] + done[0] + done[1], _CAP)
    return min(frames[0][0] + frames[0][1], _CAP)


def _schema_patterns(node: Any) -> list[str]:
    """Every regex in a JSON schema: `pattern` values and `patternProperties` keys."""
    out: list[str] = []
    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, dict):
            for k, v in n.items():
                if k == "pattern" and isinstance(v, str):
                    out.append(v)
                elif k == "patternProperties" and isinstance(v, dict):
                    out += [key for key in v if isinstance(key, str)]
                stack.append(v)
        elif isinstance(n, list):
            stack += n
    return out


def check_expansion(kind: str, text: str) -> None:
    """GrammarTooComplex when a regex of the spec unrolls past `MAX_REGEX_EXPANSION`."""
    if kind == "regex":
        patterns = [text]
    elif kind == "json":
        try:
            patterns = _schema_patterns(json.loads(text))
        except ValueError:
            return          # not JSON: the grammar build says so
    else:
        return
    for pattern in patterns:
        if (size := regex_expansion(pattern)) > MAX_REGEX_EXPANSION:
            raise _too_complex(kind, f"the pattern {pattern[:80]!r} expands to {size} repetitions "
                                     f"(at most {MAX_REGEX_EXPANSION})")


# -- the first mask, and the step's ----------------------------------------------------------------


@dataclass(slots=True, frozen=True)
class MaskCounts:
    computed: int = 0           # masks the step computed (one a row)
    over_budget: int = 0        # of them, over STEP_MASK_BUDGET_S of CPU
    first_masks: int = 0        # first masks computed at compile
    refused: int = 0            # grammars refused by a bound of this module


class MaskStats:
    """Process-wide counts (engine stats and tests read them)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = MaskCounts()

    def add(self, **deltas: int) -> None:
        with self._lock:
            c = self._counts
            self._counts = MaskCounts(*(getattr(c, k) + deltas.get(k, 0) for k in MaskCounts.__slots__))

    def snapshot(self) -> MaskCounts:
        return self._counts


MASK_STATS = MaskStats()


def _too_complex(kind: str, why: str) -> GrammarTooComplex:
    MASK_STATS.add(refused=1)
    return GrammarTooComplex(f"structured_outputs.{kind}: {why}", field=f"structured_outputs.{kind}")


def probe(matcher: llguidance.LLMatcher, vocab_size: int, kind: str) -> tuple[float, GrammarTooComplex | None]:
    """Computes `matcher`'s first mask (kept in it: its copies start from it) and checks
    what it cost: its CPU seconds, and the refusal when past a bound. (Returned, not raised:
    a raised error's traceback would keep the caller's matcher, and its lexer, alive for as
    long as the failure is cached.)"""
    row = torch.zeros((vocab_size + 31) // 32, dtype=torch.int32)
    t0 = time.thread_time()
    matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
    spent = time.thread_time() - t0
    MASK_STATS.add(first_masks=1)
    if matcher.is_error():
        return spent, _too_complex(kind, matcher.get_error()[:MAX_ERROR_CHARS])
    if spent > FIRST_MASK_BUDGET_S:
        return spent, _too_complex(kind, f"its first mask took {spent:.2f} s of CPU (at most {FIRST_MASK_BUDGET_S:g})")
    forced = matcher.compute_ff_tokens()
    if len(forced) > MAX_FORCED_TOKENS:
        return spent, _too_complex(kind, f"it forces {len(forced)} tokens in a row (at most {MAX_FORCED_TOKENS})")
    if forced:
        copy = matcher.deep_copy()
        if not copy.consume_tokens(forced[:PROBE_TOKENS]) or copy.is_error():
            return spent, _too_complex(kind, copy.get_error()[:MAX_ERROR_CHARS] or "it refuses the tokens it forces")
    return spent, None


def timed_masks(matchers: list[llguidance.LLMatcher], mask: torch.Tensor) -> None:
    """Each matcher's row of `mask` computed in place, its CPU time checked against the
    step's budget (counted in MASK_STATS)."""
    row_bytes = mask.shape[1] * mask.element_size()
    over = 0
    for i, matcher in enumerate(matchers):
        t0 = time.thread_time()
        matcher.unsafe_compute_mask_ptr(mask[i].data_ptr(), row_bytes)
        over += time.thread_time() - t0 > STEP_MASK_BUDGET_S
    MASK_STATS.add(computed=len(matchers), over_budget=over)
