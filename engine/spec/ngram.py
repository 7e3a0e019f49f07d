"""The n-gram (prompt-lookup) proposer: draft tokens for a decode from the sequence itself.

Where a model quotes its context (code being edited, a document being summarized, a list
being repeated), the tokens that followed an earlier occurrence of the latest few tokens are
a good guess at what comes next. `propose` takes the longest suffix of the sequence (prompt
and output so far) of `min_n` to `max_n` tokens that occurred earlier, and proposes up to
`k` tokens that followed its latest earlier occurrence. No model, no state: a search over the
token ids, done in C (`bytes.rfind` over the ids packed 8 bytes each).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

_WIDTH = array("q").itemsize     # bytes per packed token id


def propose(token_ids: Sequence[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to `k` draft tokens after `token_ids`, [] when no suffix of `min_n`..`max_n` tokens
    occurred earlier. The longest matching suffix wins; among its earlier occurrences, the
    latest (nearest context first). Fewer than `k` come back when the occurrence is near the
    end (what follows it runs into the suffix itself, which is allowed)."""
    num = len(token_ids)
    if k < 1 or num < min_n + 1:
        return []
    try:      # any matching suffix ends in the last token: text that never repeats it has none
        token_ids.index(token_ids[-1], 0, num - 1)
    except ValueError:
        return []
    data = array("q", token_ids).tobytes()
    # an occurrence must end before the last token, so that at least one token follows it
    end = (num - 1) * _WIDTH
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        suffix = data[(num - n) * _WIDTH:]
        pos = data.rfind(suffix, 0, end)
        while pos > 0 and pos % _WIDTH:          # a match across id boundaries: look earlier
            pos = data.rfind(suffix, 0, pos + len(suffix) - 1)
        if pos >= 0:
            start = pos // _WIDTH + n
            return list(token_ids[start:start + k])
    return []
