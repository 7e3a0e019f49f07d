"""Grammar bombs: short patterns whose counted repetitions expand to millions of states or
forced bytes. Ten distinct ones (distinct cache keys), each a few dozen bytes; a server must
refuse every one as a 400 naming the field, quickly, without keeping memory for them. The
first two stay just under the bound on a pattern's unrolled size and are refused from
their first mask (they force 10k tokens); the other eight unroll far past it (refused from
their text), so both of the server's checks are exercised. The grammar tests send these; a bench can send them
beside ordinary traffic."""

from __future__ import annotations

BOMB_PATTERNS: list[str] = [
    "y{9999}",
    "(z{2500}){4}",
    "(a{2000}){1000}",
    "(b{2000}){1000}",
    "(ab{500}){2000}",
    "x(c{1000}){1000}",
    "((d{100}){100}){100}",
    "[xy](e{2000}){1000}",
    "(f{3000}){700}z",
    "(g|h{1000}){2000}",
]
