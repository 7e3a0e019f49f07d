"""Memory handed back after a flood: glibc keeps the pages a burst of large bodies freed
(in its arenas, fragmented by what is still alive) and a gateway's resident size then stays
at its peak for good. `trim_loop` looks at the resident size every `memory_trim_interval_s`
and, while it is `memory_trim_growth_mb` above the lowest it has been, asks glibc to return
what is free (`malloc_trim(0)`, which also releases whole free pages inside arenas), on a
thread so that the event loop does not wait on it. Elsewhere than glibc it does nothing."""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
from collections.abc import Callable
from functools import cache

logger = logging.getLogger(__name__)
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def resident_bytes() -> int | None:
    """This process's resident set size (Linux), or None where /proc says nothing."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


@cache
def _malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        fn = ctypes.CDLL(name).malloc_trim      # ctypes lets go of the GIL during the call
    except (OSError, AttributeError):           # not glibc
        return None
    fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
    return fn


def trim() -> bool:
    """Return freed heap pages to the system now; False where there is no malloc_trim."""
    fn = _malloc_trim()
    if fn is None:
        return False
    fn(0)
    return True


async def trim_loop(interval_s: float, growth_bytes: int,
                    resident: Callable[[], int | None] = resident_bytes) -> None:
    """Trim whenever the resident size is `growth_bytes` above the lowest seen. While what
    is held is live (a trim gives little back) look less often, up to 4 x `interval_s`, so a
    large steady heap costs a walk of its free lists only now and then."""
    if _malloc_trim() is None or resident() is None:
        return
    low = resident() or 0
    wait = interval_s
    while True:
        await asyncio.sleep(wait)
        now = resident()
        if now is None or now - low < growth_bytes:
            low, wait = min(low, now or low), interval_s
            continue
        await asyncio.to_thread(trim)
        after = resident() or now
        logger.debug("malloc_trim: resident %d -> %d MB", now >> 20, after >> 20)
        wait = min(wait * 2, 4 * interval_s) if now - after < growth_bytes // 4 else interval_s
        low = min(low, after)
