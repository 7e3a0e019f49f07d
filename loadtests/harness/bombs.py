"""Grammar bombs: short patterns whose counted repetitions expand to millions of states or
forced bytes. Ten distinct ones (distinct cache keys), each a few dozen bytes; a server must
refuse every one as a 400 naming the field, quickly, without keeping memory for them. The
grammar tests send these; a bench can send them beside ordinary traffic."""

from __future__ import annotations

BOMB_PATTERNS: list[str] = [
    "(a{2000}){1000}",
    "(b{2000}){1000}",
    "(ab{500}){2000}",
    "x(c{1000}){1000}",
    "((d{100}){100}){100}",
    "[xy](e{2000}){1000}",
    "(f{3000}){700}z",
    "(g|h{1000}){2000}",
    "(\\d{1000}){1000}",
    "([ij]{2000}){1000}",
]
