"""An httpx transport that calls an ASGI app in this event loop, and streams its answer.

    client = httpx.AsyncClient(transport=StreamingASGITransport(app), base_url="http://test")

httpx's own `ASGITransport` runs the app to its end before it returns the response, with the
whole body: a stream's first event arrives only after its last, a client cannot leave a
stream half-read, and a request the app holds (a lease, a queued engine request) has always
finished by the time the test sees its headers. This one hands the response back at
`http.response.start` and its body chunk by chunk, as a connection to uvicorn would:

- the body is buffered up to `max_buffered_chunks` messages (a socket's buffers); past
  them the app's `send` waits for the client to read, as uvicorn's does on a full socket;
- closing the response before its end (leaving an `async with client.stream(...)` block,
  or `aclose()`) is the client going away: the app's `receive` answers `http.disconnect`
  and what it sends afterwards is dropped (uvicorn's behaviour at ASGI spec 2.3); the close
  returns once the app has finished with the request (5 s at most);
- the request's read timeout (httpx's `timeout`) applies to the headers and to each chunk:
  past it, httpx.ReadTimeout is raised and the app sees the client leave;
- an exception the app raises is logged, as uvicorn logs it, and answered 500 when no
  response was started (else the body ends there, and the client sees the body cut short).

`aclose()` (the client's) waits, a few seconds at most, for the apps still running (their
background work after the last byte), then cancels them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx

logger = logging.getLogger("tests.asgi")

_END = object()


class _Exchange:
    """One request's run of the app: what it sent, and the client's side of the connection."""

    def __init__(self, app: Any, scope: dict, request: httpx.Request, max_chunks: int) -> None:
        self.app = app
        self.scope = scope
        self.request_body = request.stream.__aiter__()       # type: ignore[union-attr]
        self.request_done = False
        self.status: int | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.started = asyncio.Event()
        self.chunks: asyncio.Queue = asyncio.Queue()
        self.max_chunks = max_chunks
        self.drained = asyncio.Event()   # the client took a chunk, or left
        self.complete = False            # the app sent its last body message
        self.gone = asyncio.Event()      # the client left, or the response is complete
        self.left = False                # the client left before the end
        self.error: BaseException | None = None

    async def receive(self) -> dict:
        if not self.request_done:
            try:
                chunk = await self.request_body.__anext__()
            except StopAsyncIteration:
                self.request_done = True
                return {"type": "http.request", "body": b"", "more_body": False}
            return {"type": "http.request", "body": chunk, "more_body": True}
        await self.gone.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict) -> None:
        if self.left:
            return                      # uvicorn drops what is sent to a closed connection
        kind = message["type"]
        if kind == "http.response.start":
            assert self.status is None, "http.response.start sent twice"
            self.status = message["status"]
            self.headers = list(message.get("headers") or [])
            self.started.set()
        elif kind == "http.response.body":
            assert self.status is not None and not self.complete, f"body out of turn: {message}"
            body = message.get("body", b"")
            if body and self.scope["method"] != "HEAD":
                await self._put(body)
            if not message.get("more_body", False):
                self.complete = True
                self.gone.set()
                self.chunks.put_nowait(_END)

    async def _put(self, item: object) -> None:
        """Queue a body chunk, waiting while the buffer is full (until the client reads, or
        leaves: then the chunk is dropped)."""
        while not self.left and self.chunks.qsize() >= self.max_chunks:
            self.drained.clear()
            await self.drained.wait()
        if not self.left:
            self.chunks.put_nowait(item)

    async def run(self) -> None:
        try:
            await self.app(self.scope, self.receive, self.send)
        except asyncio.CancelledError:
            raise
        except Exception as exc:     # what uvicorn does: log it, answer 500 if it still can
            self.error = exc
            logger.error("Exception in ASGI application", exc_info=exc)
            if self.status is None:
                self.status = 500
                self.headers = [(b"content-type", b"text/plain; charset=utf-8")]
                self.started.set()
                await self._put(b"Internal Server Error")
        finally:
            self.started.set()
            if not self.complete:
                self.complete = True
                self.gone.set()
                self.chunks.put_nowait(_END)

    def leave(self) -> None:
        """The client closes the connection."""
        if not self.complete:
            self.left = True
            self.gone.set()
        self.drained.set()                  # a send waiting on a full buffer drops its chunk


class _Body(httpx.AsyncByteStream):
    def __init__(self, exchange: _Exchange, task: asyncio.Task, request: httpx.Request,
                 read_timeout: float | None) -> None:
        self.exchange = exchange
        self.task = task
        self.request = request
        self.read_timeout = read_timeout

    async def __aiter__(self) -> AsyncIterator[bytes]:
        ex = self.exchange
        while True:
            try:
                item = await asyncio.wait_for(ex.chunks.get(), self.read_timeout)
                ex.drained.set()
            except TimeoutError:
                ex.leave()
                raise httpx.ReadTimeout("no body chunk within the read timeout", request=self.request) from None
            if item is _END:
                if ex.error is not None and ex.status != 500:
                    raise httpx.RemoteProtocolError("the server closed the connection mid-body",
                                                    request=self.request)
                return
            yield item

    async def aclose(self) -> None:
        """Closing the connection: when the client leaves before the end, this returns once
        the app has finished with the request (5 s at most), so that what it holds (a lease,
        an engine request) is released before the client's next request, as a server that
        reads the connection's end has done by the time a new connection's request arrives."""
        left = not self.exchange.complete
        self.exchange.leave()
        if left:
            await asyncio.wait({self.task}, timeout=5)


class StreamingASGITransport(httpx.AsyncBaseTransport):
    def __init__(self, app: Any, *, client: tuple[str, int] = ("127.0.0.1", 40000),
                 max_buffered_chunks: int = 64) -> None:
        self.app = app
        self.client = client
        self.max_buffered_chunks = max_buffered_chunks
        self.tasks: set[asyncio.Task] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        read_timeout = (request.extensions.get("timeout") or {}).get("read")
        scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1",
            "method": request.method,
            "headers": [(k.lower(), v) for k, v in request.headers.raw],
            "scheme": request.url.scheme,
            "path": request.url.path,
            "raw_path": request.url.raw_path.split(b"?")[0],
            "query_string": request.url.query,
            "server": (request.url.host, request.url.port or 80),
            "client": self.client,
            "root_path": "",
        }
        ex = _Exchange(self.app, scope, request, self.max_buffered_chunks)
        task = asyncio.get_running_loop().create_task(ex.run(), name=f"asgi {request.method} {request.url.path}")
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        try:
            await asyncio.wait_for(ex.started.wait(), read_timeout)
        except TimeoutError:
            ex.leave()
            raise httpx.ReadTimeout("no response within the read timeout", request=request) from None
        except asyncio.CancelledError:
            ex.leave()
            raise
        assert ex.status is not None
        return httpx.Response(ex.status, headers=ex.headers, stream=_Body(ex, task, request, read_timeout),
                              extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self.tasks:
            _, pending = await asyncio.wait(set(self.tasks), timeout=5)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=5)
