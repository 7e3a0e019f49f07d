"""`Httpx2Bridge`: an `httpx2` transport (the `anthropic` client's HTTP library, a fork of
httpx whose objects do not mix with httpx's) over an httpx transport, so that the official
client calls the app in process through tests/support/asgi_transport.py's
`StreamingASGITransport`, answers streamed as they are sent.

    http = httpx2.AsyncClient(transport=Httpx2Bridge(gw.transport), base_url=gw.url)
    anthropic.AsyncAnthropic(base_url=gw.url, api_key=key, http_client=http)
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import httpx2


class _Body(httpx2.AsyncByteStream):
    def __init__(self, response: httpx.Response) -> None:
        self.response = response

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.aiter_raw():
            yield chunk

    async def aclose(self) -> None:
        await self.response.aclose()


class Httpx2Bridge(httpx2.AsyncBaseTransport):
    def __init__(self, transport: httpx.AsyncBaseTransport) -> None:
        self.transport = transport

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        body = await request.aread()
        inner = httpx.Request(request.method, str(request.url), headers=list(request.headers.raw),
                              content=body, extensions={k: v for k, v in request.extensions.items()
                                                        if k == "timeout"})
        response = await self.transport.handle_async_request(inner)
        wrapped = httpx.Response(response.status_code, headers=response.headers, stream=response.stream,
                                 request=inner)
        return httpx2.Response(response.status_code, headers=list(response.headers.raw), stream=_Body(wrapped),
                               request=request)
