"""A batch's input, read before anything is stored: the input file's JSONL lines in OpenAI's
request shape (a malformed line kept as an error line, answered without running), and the
batch's metadata. Pure functions, no database: `batches.create_batch` runs `parse_input`
off the event loop."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from lockgate.tenancy.errors import Invalid

METADATA_MAX_PAIRS = 16


@dataclass(slots=True)
class InputLine:
    line: int
    custom_id: str | None
    body: dict[str, Any] | None
    error: dict[str, Any] | None      # a malformed line: its error, answered without running


def parse_input(content: bytes, *, endpoint: str, max_lines: int) -> list[InputLine]:
    """The lines of a batch's input file. A line that is not a request to `endpoint` in
    OpenAI's shape (`custom_id`, `method` POST, `url`, `body`) is kept as an error line;
    the file as a whole is refused (Invalid "input_file_id") only when it cannot be read:
    not UTF-8, no lines, more than `max_lines`."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid("input_file_id", f"the file is not UTF-8 text (byte {exc.start})") from None
    # JSONL lines end at "\n" alone (str.splitlines would also cut at U+2028 and the like,
    # which JSON strings may hold); a line is numbered by its place in the file
    raw = [(n, ln) for n, ln in enumerate(text.split("\n")) if ln.strip()]
    if not raw:
        raise Invalid("input_file_id", "the file has no lines")
    if len(raw) > max_lines:
        raise Invalid("input_file_id", f"the file has {len(raw)} lines; at most {max_lines} per batch")
    seen: set[str] = set()
    return [_parse_line(n, ln, endpoint, seen) for n, ln in raw]


def _parse_line(n: int, text: str, endpoint: str, seen: set[str]) -> InputLine:
    custom_id: str | None = None

    def bad(message: str, code: str = "invalid_request") -> InputLine:
        return InputLine(n, custom_id, None, {"code": code, "message": f"line {n + 1}: {message}"})

    try:
        obj = json.loads(text)
    except ValueError as exc:
        return bad(f"not JSON ({getattr(exc, 'msg', exc)})", "invalid_json_line")
    if not isinstance(obj, dict):
        return bad("must be a JSON object")
    cid = obj.get("custom_id")
    if not isinstance(cid, str) or not 1 <= len(cid) <= 512:
        return bad("custom_id: must be a string of 1 to 512 characters")
    custom_id = cid
    if cid in seen:
        return bad(f"custom_id: {cid!r} appears more than once in the file", "duplicate_custom_id")
    seen.add(cid)
    if obj.get("method") != "POST":
        return bad("method: must be POST")
    if obj.get("url") != endpoint:
        return bad(f"url: must be the batch's endpoint {endpoint}", "mismatched_endpoint")
    if not isinstance(obj.get("body"), dict):
        return bad("body: must be a JSON object (the request's body)")
    if obj["body"].get("stream"):
        return bad("body.stream: a batch line cannot stream")
    return InputLine(n, cid, obj["body"], None)


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > METADATA_MAX_PAIRS:
        raise Invalid("metadata", f"must be an object of at most {METADATA_MAX_PAIRS} pairs")
    for k, v in metadata.items():
        if not isinstance(k, str) or not 1 <= len(k) <= 64 or not isinstance(v, str) or len(v) > 512:
            raise Invalid("metadata", "keys must be strings of 1 to 64 characters, values strings "
                                      "of at most 512")
    return dict(metadata)
