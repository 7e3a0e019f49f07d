"""One pipelined Redis connection for the limiter's scripts: EVALSHA, and EVAL after NOSCRIPT.

Why not redis-py's asyncio client, which would otherwise do: every admitted request makes two
limiter calls (acquire and settle), and under `lockgate bench gateway` redis-py's per-command
Python work (pool checkout, retry wrapper, packing the command in Python, the async read
loop) was the largest single part of the gateway process's py-spy samples. Here hiredis
(the C extension redis-py itself uses to parse) packs each command and parses the replies,
and one asyncio Protocol carries everything: commands are written as they come, Redis
answers them in order, and replies go to their waiters first in, first out.

What it keeps from redis-py: its URL parser (redis://, rediss://, unix://, user, password,
db) and its exception types (`redis.exceptions.ConnectionError`, `ResponseError`), so
callers handle failures as before. What it leaves out: pub/sub, blocking commands,
transactions, cluster and Sentinel (for those the limiter uses redis-py's own clients:
`redis_conn`). A connection found closed is
opened again before the next command; a command whose connection breaks after it was
written fails with ConnectionError (it may or may not have run: no blind retry).

Every wait is bounded by ``timeout`` (250 ms by default): the connect, the AUTH and SELECT
sent at connect, and each reply. A Redis that accepts connections and never answers (stopped,
swapping, stuck in a slow script) makes the waiting command raise `redis.exceptions.TimeoutError`
and the connection is dropped: replies come in order, so every command written on it after the
one that timed out would wait behind it. Its other waiters fail at once with ConnectionError,
and the next command opens a new connection.

The timeout measures Redis, not this process's event loop (`_Deadline`): it runs from when
the command is written, and when it passes with no reply, Redis is declared silent only if
it said nothing during it: no byte read on the connection in that time, none waiting unread
in the socket, and the command not stuck in our own write buffer while the socket would take
it. Otherwise the loop, not Redis, is behind (a flood keeping it busy, a long callback), and
the command is given another ``timeout``, at most `MAX_EXTENSIONS` times. So a Redis that
stops answering fails a command within 2 x ``timeout`` of its last byte (``timeout`` when it
said nothing since the command was written), and any command within
(1 + `MAX_EXTENSIONS`) x ``timeout`` whatever happens.
"""

from __future__ import annotations

import asyncio
import hashlib
import select
import ssl as ssl_lib
from collections import deque
from typing import Any

import hiredis
from redis.connection import SSLConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError


class _Pipe(asyncio.Protocol):
    """The connection: replies handed to waiting futures in the order commands were sent."""

    def __init__(self) -> None:
        self.reader = hiredis.Reader()
        self.waiters: deque[asyncio.Future] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: RedisConnectionError | None = None
        self.received = 0           # bytes read so far: a deadline's evidence that Redis speaks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received += len(data)
        self.reader.feed(data)
        try:
            while (reply := self.reader.gets()) is not False:
                waiter = self.waiters.popleft()
                if not waiter.done():       # its caller may have been cancelled meanwhile
                    waiter.set_result(reply)
        except (hiredis.ProtocolError, IndexError) as exc:  # garbage, or a reply nobody asked for
            self.lost = RedisConnectionError(f"bad reply from Redis: {exc!r}")
            if self.transport is not None:
                self.transport.abort()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.lost is None:
            self.lost = RedisConnectionError(f"connection to Redis lost: {exc or 'closed by the server'}")
        while self.waiters:
            waiter = self.waiters.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)


class RedisPipe:
    """Commands over one pipelined connection, opened on first use."""

    one_slot = False        # one node: a script may touch any keys

    def __init__(self, url: str, *, timeout: float = 0.25) -> None:
        if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
            raise ValueError(f"timeout: must be a positive number of seconds, got {timeout!r}")
        kw = parse_url(url)
        self.path: str | None = kw.get("path")
        self.host: str = kw.get("host", "localhost")
        self.port: int = int(kw.get("port", 6379))
        self.db = int(kw.get("db") or 0)
        self.username: str | None = kw.get("username")
        self.password: str | None = kw.get("password")
        self.ssl = ssl_lib.create_default_context() if kw.get("connection_class") is SSLConnection else None
        self.where = self.path or f"{self.host}:{self.port}"
        self.timeout = float(timeout)
        self._pipe: _Pipe | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._connecting: asyncio.Future | None = None

    async def execute(self, *args: Any) -> Any:
        """Send one command, wait for its reply. A Redis error reply raises ResponseError."""
        pipe = self._pipe
        if (pipe is None or pipe.lost is not None or self._loop is not asyncio.get_running_loop()
                or pipe.transport is None or pipe.transport.is_closing()):
            pipe = await self._connect()
        return await self._send(pipe, args)

    async def _send(self, pipe: _Pipe, args: tuple) -> Any:
        if pipe.transport is None:      # a pipe is only handed out once connected
            raise RedisConnectionError(f"not connected to Redis at {self.where}")
        waiter = asyncio.get_running_loop().create_future()
        pipe.waiters.append(waiter)
        pipe.transport.write(hiredis.pack_command(args))
        deadline = _Deadline(self, pipe, waiter)
        try:
            reply = await waiter
        finally:
            deadline.cancel()
        if isinstance(reply, hiredis.ReplyError):
            raise ResponseError(str(reply))
        return reply

    @staticmethod
    def _drop(pipe: _Pipe, why: str) -> None:
        """Close `pipe` now: its waiters fail with ConnectionError (`why`), the next command
        opens a new connection."""
        if pipe.lost is None:
            pipe.lost = RedisConnectionError(why)
        if pipe.transport is not None:
            pipe.transport.abort()      # connection_lost fails the waiters, on the next turn

    async def _connect(self) -> _Pipe:
        """The live connection, opening one if needed; concurrent callers share one attempt."""
        loop = asyncio.get_running_loop()
        if self._connecting is not None and self._loop is loop and not self._connecting.done():
            return await asyncio.shield(self._connecting)
        self._loop = loop
        self._connecting = loop.create_task(self._open())
        return await asyncio.shield(self._connecting)

    async def _open(self) -> _Pipe:
        old, self._pipe = self._pipe, None
        if old is not None and old.transport is not None:
            old.transport.abort()
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.timeout):
                if self.path:
                    transport, pipe = await loop.create_unix_connection(_Pipe, self.path)
                else:
                    transport, pipe = await loop.create_connection(_Pipe, self.host, self.port, ssl=self.ssl)
        except (OSError, TimeoutError) as exc:
            raise RedisConnectionError(f"cannot connect to Redis at {self.where}: {exc or 'timed out'}") from None
        try:
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                await self._send(pipe, ("AUTH", *auth))
            if self.db:
                await self._send(pipe, ("SELECT", self.db))
        except BaseException:
            transport.abort()
            raise
        self._pipe = pipe
        return pipe

    async def aclose(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None and pipe.transport is not None and self._loop is asyncio.get_running_loop():
            pipe.transport.close()


MAX_EXTENSIONS = 20
"""How many more timeouts a command may wait while the event loop, not Redis, is behind."""


def _socket_ready(transport: asyncio.Transport, events: int) -> bool:
    """Whether the transport's socket is ready for `events` (poll's) right now."""
    sock = transport.get_extra_info("socket")
    if sock is None or not hasattr(select, "poll"):
        return False
    try:
        poller = select.poll()
        poller.register(sock.fileno(), events)
        return bool(poller.poll(0))
    except (OSError, ValueError):
        return False


class _Deadline:
    """One command's timeout, armed when it is written: see the module docstring."""

    def __init__(self, owner: RedisPipe, pipe: _Pipe, waiter: asyncio.Future) -> None:
        self.owner = owner
        self.pipe = pipe
        self.waiter = waiter
        self.seen = pipe.received
        self.extensions = 0
        self.handle = asyncio.get_running_loop().call_later(owner.timeout, self._expire)

    def cancel(self) -> None:
        self.handle.cancel()

    def _loop_behind(self) -> bool:
        """Whether Redis spoke since the deadline was armed, or the command is ours to send."""
        transport = self.pipe.transport
        if self.pipe.received != self.seen:
            return True
        if transport is None or transport.is_closing():
            return False
        if _socket_ready(transport, select.POLLIN):
            return True
        return transport.get_write_buffer_size() > 0 and _socket_ready(transport, select.POLLOUT)

    def _expire(self) -> None:
        if self.waiter.done():
            return
        if self.extensions < MAX_EXTENSIONS and self._loop_behind():
            self.extensions += 1
            self.seen = self.pipe.received
            self.handle = asyncio.get_running_loop().call_later(self.owner.timeout, self._expire)
            return
        where, timeout = self.owner.where, self.owner.timeout
        self.waiter.set_exception(RedisTimeoutError(f"Redis at {where} did not answer within {timeout:g} s"))
        self.owner._drop(self.pipe, f"no reply from Redis at {where} within {timeout:g} s")


class RedisScript:
    """A Lua script run by its SHA-1; sent whole once when Redis does not know it (first use,
    or after a restart or SCRIPT FLUSH). ``pipe`` is a `RedisPipe` or anything with its
    ``execute`` (`redis_conn.ClientConnection`: on Redis Cluster both EVALSHA and the EVAL
    after NOSCRIPT go to the node that owns the keys' slot, which then caches the script)."""

    def __init__(self, pipe: Any, source: str) -> None:
        self.pipe = pipe
        self.source = source
        self.sha = hashlib.sha1(source.encode(), usedforsecurity=False).hexdigest()

    async def __call__(self, keys: list[str], args: list[Any]) -> Any:
        try:
            return await self.pipe.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except ResponseError as exc:
            # redis-py's clients raise NoScriptError, its message stripped of the code
            if not isinstance(exc, NoScriptError) and not str(exc).startswith("NOSCRIPT"):
                raise
            return await self.pipe.execute("EVAL", self.source, len(keys), *keys, *args)
