"""`Background`: the gateway's own fire-and-forget tasks (a key's last use, a cache refresh),
kept so that none is lost to the garbage collector and a shutdown waits for what is left."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
