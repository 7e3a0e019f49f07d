"""The gateway under `lockgate bench gateway`: one uvicorn worker serving
`create_app(Settings(), engine_factory=InstantEngine)`, settings from `LOCKGATE_*` variables
(the benchmark sets the database, Redis, prefix, pepper, admin key and models).

    python -m loadtests.gateway_bench_server --port 8123
    python -m loadtests.gateway_bench_server --port 8124 --null    # bare uvicorn: the HTTP floor

uvicorn runs as `lockgate serve` runs it (its default loop and HTTP parser: uvloop and
httptools where installed, no access log). `--null` serves a fixed chat-completion body with
no gateway behind it: what the HTTP stack alone costs with the same client.
"""

from __future__ import annotations

import argparse
import json
import os

import uvicorn

NULL_BODY = json.dumps({
    "id": "chatcmpl-null", "object": "chat.completion", "created": 0, "model": "bench",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": " The quick bro"},
                 "logprobs": None, "finish_reason": "length"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 8, "total_tokens": 28},
}).encode()


async def null_app(scope, receive, send) -> None:
    """Reads the whole body, answers 200 with NULL_BODY; /ready answers too."""
    if scope["type"] == "lifespan":
        while True:
            msg = await receive()
            if msg["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif msg["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return
    if scope["type"] != "http":
        return
    more = True
    while more:
        msg = await receive()
        if msg["type"] == "http.disconnect":
            return
        more = msg.get("more_body", False)
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(NULL_BODY)).encode())]})
    await send({"type": "http.response.body", "body": NULL_BODY})


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--null", action="store_true", help="bare uvicorn, no gateway")
    args = ap.parse_args(argv)
    if args.null:
        app = null_app
    else:
        from lockgate.gateway.app import create_app
        from lockgate.gateway.settings import Settings
        from lockgate.loadtests.instant_engine import InstantEngine

        app = create_app(Settings(), engine_factory=InstantEngine)
    config = uvicorn.Config(app, host=args.host, port=args.port,
                            log_level=os.environ.get("LOCKGATE_BENCH_LOG_LEVEL", "warning"),
                            lifespan="on", access_log=False, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run()


if __name__ == "__main__":
    main()
