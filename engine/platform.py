"""Process-level settings for running the engine on a CPU."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def tune_cpu_allocator() -> None:
    """Keep glibc from returning large buffers to the OS after every op.

    Each step allocates the same multi-MB activation and gather buffers. By default glibc
    serves those with fresh mmaps and unmaps them on free, so every step pays page faults
    on memory it had a moment ago, a cost a reused buffer does not have. Serving
    buffers up to 32 MB from the heap and not trimming it fixes that; the KV cache itself
    is larger and still mmapped, so its untouched pages stay out of resident memory.
    """
    global _done
    if _done or not sys.platform.startswith("linux"):
        return
    _done = True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        ok = libc.mallopt(_M_MMAP_THRESHOLD, 32 * 1024 * 1024) and libc.mallopt(
            _M_TRIM_THRESHOLD, 1024 * 1024 * 1024
        )
    except (OSError, AttributeError):   # not glibc (musl, ...): leave the allocator alone
        ok = False
    if not ok:
        logger.debug("mallopt unavailable; CPU allocator left as it is")
