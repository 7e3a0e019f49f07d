"""A finished batch as the load test counts it: its lines' tokens, read from the output and
error files' bodies (OpenAI's shapes), and whether it was served. Shared by the locustfile's
batch submitters and by `lockgate loadtest` for batches still running when locust stopped;
imports nothing (the CLI must not import locust, which patches the standard library)."""

from __future__ import annotations

import json
from collections.abc import Callable

TERMINAL_BATCH = ("completed", "failed", "expired", "cancelled")


def collect_batch(batch: dict, download: Callable[[str], bytes | None]) -> dict:
    """A batch's sample fields (outcome, lines, lines_ok, prompt_tokens, completion_tokens,
    error) from its last state; `download(path)` gives a file's bytes or None."""
    if batch["status"] not in TERMINAL_BATCH:
        return {"outcome": "failed", "error": f"still {batch['status']} at the deadline", "lines": 0}
    prompt = completion = num_ok = num_lines = 0
    for key in ("output_file_id", "error_file_id"):
        if not batch.get(key):
            continue
        content = download(f"/v1/files/{batch[key]}/content")
        for line in (content or b"").splitlines():
            answer = json.loads(line)
            num_lines += 1
            response = answer.get("response") or {}
            usage = (response.get("body") or {}).get("usage") or {}
            prompt += usage.get("prompt_tokens", 0)
            completion += usage.get("completion_tokens", 0)
            num_ok += response.get("status_code") == 200 and not answer.get("error")
    ok = batch["status"] == "completed" and num_lines > 0 and num_ok == num_lines
    return {"outcome": "ok" if ok else "failed", "lines": num_lines, "lines_ok": num_ok,
            "prompt_tokens": prompt, "completion_tokens": completion,
            "error": None if ok else f"batch {batch['status']}, {num_ok}/{num_lines} lines ok"}
