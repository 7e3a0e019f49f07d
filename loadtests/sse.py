"""A streamed OpenAI response (server-sent events) read to its end, for the locust suites
(locustfile.py, locust_mix.py). No locust import: the suites' modules register locust event
listeners when imported, so neither can import the other."""

from __future__ import annotations

import json
import time


def read_sse(response) -> tuple[list[float], dict | None, object, bool]:
    """A stream's content-chunk arrival times (perf_counter), its usage chunk, its error
    event (or None) and whether it ended with `[DONE]`. `response`: a locust FastHttpUser's,
    opened with stream=True."""
    times: list[float] = []
    usage = error = None
    done = False
    buf = b""
    for chunk in response.iter_content(chunk_size=512, decode_content=False):
        buf += chunk
        while b"\n\n" in buf:
            event, buf = buf.split(b"\n\n", 1)
            if not event.startswith(b"data: "):
                continue
            payload = event[6:]
            if payload == b"[DONE]":
                done = True
                continue
            data = json.loads(payload)
            if "error" in data:
                error = data["error"]
            elif data.get("usage"):
                usage = data["usage"]
            if any((c.get("delta") or {}).get("content") or c.get("text") for c in data.get("choices") or ()):
                times.append(time.perf_counter())
    return times, usage, error, done
