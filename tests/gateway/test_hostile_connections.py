"""Hostile clients on the wire, against a live `lockgate serve` (uvicorn and the gateway's
connection-level limits are what is tested; raw sockets where the bytes on the wire
matter): header limits and the header read deadline (before authentication), a client that
leaves mid-upload, and a readable 413 while the client is still sending; concurrent large
chunked uploads held on disk, not in memory (the server's RSS, sampled while they run), a
tenant's uploads past its cap in flight answered 429 before their bodies are read, and a body
dripped a byte at a time answered 408 at its deadline, the connection closed and the
tenant's concurrency slot freed. (Hostile request bodies, in process: test_hostile_input.py;
uploads' admission and their files' round trip: test_uploads.py.)"""

from __future__ import annotations

import contextlib
import json
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_server import GatewayServer

HEADER_TIMEOUT_S = 0.5
MAX_HEADER_BYTES = 32 << 10
BODY_READ_TIMEOUT_S = 2.0
TENANT_UPLOADS = 3                    # the per-tenant cap on uploads in flight
UPLOAD_BYTES = 20 << 20
PIECE = 256 << 10                     # bytes per HTTP chunk
BOUNDARY = "lgtestboundary"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = GatewayServer.start(tmp_path_factory.mktemp("hostile-wire"), extra_env={
        "LOCKGATE_HEADER_TIMEOUT_S": str(HEADER_TIMEOUT_S),
        "LOCKGATE_MAX_HEADER_BYTES": str(MAX_HEADER_BYTES),
        "LOCKGATE_BODY_READ_TIMEOUT_S": str(BODY_READ_TIMEOUT_S),
        "LOCKGATE_MAX_TENANT_UPLOADS_IN_FLIGHT": str(TENANT_UPLOADS),
        "LOCKGATE_MAX_FILE_BYTES": str(UPLOAD_BYTES + (1 << 20)),
        "LOCKGATE_BATCH_MAX_LINES": "100000",
    })
    try:
        yield srv
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def key(server) -> str:
    return server.tenant()[1]


def addr(server) -> tuple[str, int]:
    u = httpx.URL(server.url)
    return u.host, int(u.port or 80)


def post(server, key: str, path: str, body: bytes | dict, **headers: str) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    h = {"Authorization": f"Bearer {key}", "content-type": "application/json", **headers}
    return httpx.post(server.url + path, content=content, headers=h, timeout=10)


def err(r: httpx.Response) -> dict:
    assert r.headers["content-type"].startswith("application/json"), r.text
    return r.json()["error"]


def send_until_refused(server, head: bytes, filler: bytes, total: int) -> tuple[int, bytes]:
    """Send `head`, then `filler` until `total` bytes or the server closes; then read what it
    answered. (bytes sent, the answer's first bytes: b"" when it closed without one)."""
    sent = 0
    with socket.create_connection(addr(server), timeout=5) as s:
        try:
            s.sendall(head)
            while sent < total:
                s.sendall(filler)
                sent += len(filler)
            s.sendall(b"\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        try:
            return sent, s.recv(4096)
        except ConnectionResetError:
            return sent, b""


# -- header limits and the header read deadline ------------------------------------------------------
def test_huge_header_is_refused_before_auth(server):
    """One 16 MiB header: 431 with a JSON error (or, when the client is still sending as the
    server closes, a reset before all was sent), never an authentication answer. (The bytes a
    client manages to send include what the kernel's socket buffers hold; the server reads
    at most `max_header_bytes` and one read buffer more.)"""
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Big: "
    sent, answer = send_until_refused(server, head, b"a" * (64 << 10), 16 << 20)
    assert answer.startswith(b"HTTP/1.1 431") or (answer == b"" and sent < 16 << 20), \
        f"{sent} bytes of one header sent; the server answered {answer[:40]!r}"


def test_hundred_thousand_headers_are_refused(server):
    head = b"GET /v1/models HTTP/1.1\r\nHost: x\r\n"
    lines = b"".join(b"X-H%d: v\r\n" % i for i in range(1000))
    sent, answer = send_until_refused(server, head, lines, 100 * len(lines))
    assert answer.startswith(b"HTTP/1.1 431") or (answer == b"" and sent < 100 * len(lines)), \
        f"{sent} bytes of 100k headers sent; the server answered {answer[:40]!r}"


def test_partial_headers_are_closed_after_the_header_timeout(server):
    """Slow clients dripping a header byte at a time are closed once the header deadline
    passes (a deadline from the request's start, not an idle timer)."""
    conns = [socket.create_connection(addr(server), timeout=5) for _ in range(20)]
    try:
        for s in conns:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        deadline = time.monotonic() + HEADER_TIMEOUT_S + 1.5
        open_conns = list(conns)
        while open_conns and time.monotonic() < deadline:
            for s in list(open_conns):
                try:
                    s.sendall(b"a")
                except (BrokenPipeError, ConnectionResetError):
                    open_conns.remove(s)
            time.sleep(0.1)
        assert not open_conns, f"{len(open_conns)} of 20 partial-header connections still open " \
                               f"{HEADER_TIMEOUT_S + 1.5} s later"
    finally:
        for s in conns:
            s.close()
    assert httpx.get(server.url + "/health").status_code == 200


# -- a client that leaves mid-upload ------------------------------------------------------------------
def test_disconnect_mid_upload_logs_no_error(server, key):
    log = server.data_dir / f"server-{addr(server)[1]}.log"
    before = log.stat().st_size
    for path, bearer in [("/v1/chat/completions", key), ("/admin/v1/tenants", server.admin_key)] * 2:
        with socket.create_connection(addr(server), timeout=5) as s:
            s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" % path.encode()
                      + b"Authorization: Bearer " + bearer.encode() + b"\r\nContent-Length: 100000\r\n\r\n"
                      + b'{"model": "tiny", "messages": [' + b" " * 1000)
            time.sleep(0.2)
    time.sleep(0.5)
    assert httpx.get(server.url + "/health").status_code == 200
    with log.open("rb") as f:
        f.seek(before)
        new = f.read().decode(errors="replace")
    assert "Traceback" not in new and "ERROR" not in new, new[-3000:]


# -- a readable 413 ---------------------------------------------------------------------------------
def test_over_limit_content_length_gets_a_readable_413(server, key):
    """The 413 goes out on the headers alone; the client, still sending, can read it."""
    with socket.create_connection(addr(server), timeout=5) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: %d\r\n\r\n" % (64 << 20))
        answer, sent = b"", 0
        try:
            while sent < 64 << 20 and b"\r\n\r\n" not in answer:
                s.sendall(b"x" * (256 << 10))
                sent += 256 << 10
                s.setblocking(False)
                with contextlib.suppress(BlockingIOError):
                    answer += s.recv(65536)
                s.setblocking(True)
        except (BrokenPipeError, ConnectionResetError) as exc:
            pytest.fail(f"connection reset after {sent} bytes, before a readable answer: {exc!r}")
        s.settimeout(5)
        while b"request_too_large" not in answer:
            chunk = s.recv(65536)
            if not chunk:
                break
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413"), answer[:200]
    assert b"request_too_large" in answer
    assert sent < 64 << 20, "the whole body was sent before the answer came"


def test_over_limit_upload_on_a_closing_connection_can_read_its_413(server, key):
    """`Connection: close` (or HTTP/1.0): the server must not close (and so reset) the
    connection under a client still sending; it reads and drops the rest for a while."""
    for total in (2 << 20, 8 << 20):
        with socket.create_connection(addr(server), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Connection: close\r\nAuthorization: Bearer " + key.encode()
                      + b"\r\nContent-Length: %d\r\n\r\n" % total)
            try:
                for _ in range(total // (256 << 10)):
                    s.sendall(b"x" * (256 << 10))
                answer = b""
                while b"request_too_large" not in answer and (chunk := s.recv(65536)):
                    answer += chunk
            except (BrokenPipeError, ConnectionResetError) as exc:
                pytest.fail(f"{total} bytes: connection reset under the upload: {exc!r}")
        assert answer.startswith(b"HTTP/1.1 413") and b"request_too_large" in answer, answer[:300]


# -- request bodies: uploads held on disk, the body read deadline -----------------------------------
def rss_bytes(pid: int) -> int:
    for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
        if ln.startswith("VmRSS:"):
            return int(ln.split()[1]) * 1024
    raise AssertionError("no VmRSS")


class PeakRSS:
    """The process's RSS, sampled every 20 ms on a thread while the block runs."""

    def __init__(self, pid: int) -> None:
        self.pid, self.peak, self.stop = pid, 0, threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, rss_bytes(self.pid))
            self.stop.wait(0.02)

    def __enter__(self) -> PeakRSS:
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()


def chunk(data: bytes) -> bytes:
    return b"%x\r\n" % len(data) + data + b"\r\n"


def file_content(size: int) -> bytes:
    line = json.dumps({"custom_id": "c", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"model": "tiny", "messages": [{"role": "user", "content": "x" * 900}]}})
    one = (line + "\n").encode()
    return one * (size // len(one))


def open_upload(server, key: str, head_of_file: bytes) -> socket.socket:
    """A chunked multipart upload: its headers and the first part of its file sent."""
    s = socket.create_connection(addr(server), timeout=30)
    s.sendall(b"POST /v1/files HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n"
              b"Content-Type: multipart/form-data; boundary=" + BOUNDARY.encode() + b"\r\n"
              b"Authorization: Bearer " + key.encode() + b"\r\n\r\n")
    preamble = (f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{BOUNDARY}\r\ncontent-disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
                "content-type: application/jsonl\r\n\r\n").encode()
    s.sendall(chunk(preamble + head_of_file))
    return s


def finish_upload(s: socket.socket, rest: bytes) -> int:
    with contextlib.closing(s):
        for at in range(0, len(rest), PIECE):
            s.sendall(chunk(rest[at:at + PIECE]))
        s.sendall(chunk(f"\r\n--{BOUNDARY}--\r\n".encode()) + b"0\r\n\r\n")
        return read_status(s)


def read_status(s: socket.socket) -> int:
    answer = b""
    while b"\r\n" not in answer:
        data = s.recv(65536)
        assert data, f"closed without an answer: {answer!r}"
        answer += data
    return int(answer.split(b" ", 2)[1])


def test_concurrent_chunked_uploads_are_not_held_in_memory_and_past_the_cap_are_429(server):
    """Two tenants each open 4 uploads of 20 MB at once (cap 3 each): exactly one of each
    tenant's is refused, before its body is read; the 6 others are sent whole, together,
    while the server's RSS grows by far less than the 120 MB they carry."""
    keys = [server.tenant()[1] for _ in range(2)]
    content = file_content(UPLOAD_BYTES)
    head, rest = content[:PIECE], content[PIECE:]
    # warm up what an upload runs (the first one loads code and opens files)
    assert finish_upload(open_upload(server, keys[0], head), rest[:PIECE]) == 200
    baseline = rss_bytes(server.proc.pid)
    socks = [(k, open_upload(server, k, head)) for k in keys for _ in range(4)]
    refused: dict[str, int] = {k: 0 for k in keys}
    deadline = time.monotonic() + 10
    waiting = {s: k for k, s in socks}      # until refused; the rest wait for their body
    while sum(refused.values()) < 2 and time.monotonic() < deadline:
        ready, _, _ = select.select(list(waiting), [], [], 0.1)
        for s in ready:
            assert read_status(s) == 429
            refused[waiting.pop(s)] += 1
            s.close()
    with PeakRSS(server.proc.pid) as rss, ThreadPoolExecutor(len(waiting)) as pool:
        statuses = list(pool.map(lambda s: finish_upload(s, rest), list(waiting)))
    growth = rss.peak - baseline
    # what is left is about 30 MiB of threads and database connections, whatever the size
    assert growth < 6 * UPLOAD_BYTES // 2, f"RSS grew by {growth >> 20} MiB"
    assert refused == {k: 1 for k in keys}
    assert statuses == [200] * 6
    # the files are whole
    listed = httpx.get(server.url + "/v1/files", headers={"Authorization": f"Bearer {keys[1]}"}).json()
    assert [f["bytes"] for f in listed["data"]] == [len(content)] * 3


def test_a_dripped_body_is_408_at_its_deadline_and_frees_the_tenants_slot(server):
    log = server.data_dir / f"server-{addr(server)[1]}.log"
    before = log.stat().st_size
    _, key = server.tenant(quota={"max_concurrent_requests": 1})
    auth = {"Authorization": f"Bearer {key}"}
    with socket.create_connection(addr(server), timeout=10) as s:
        s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Authorization: Bearer " + key.encode() + b"\r\nContent-Length: 100000\r\n\r\n")
        s.sendall(b"{")
        time.sleep(0.5)
        # the slow request holds the tenant's one slot while it is read
        r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=10,
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 429, r.text
        answer = b""
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            for _ in range(40):           # a byte every 0.5 s: far past the deadline
                ready, _, _ = select.select([s], [], [], 0.5)
                if ready:
                    break
                s.sendall(b" ")
            while data := s.recv(65536):   # the answer, then the close (b"")
                answer += data
    assert answer.startswith(b"HTTP/1.1 408"), answer[:300]
    assert b"request_timeout" in answer and b"connection: close" in answer.lower()
    r = httpx.post(server.url + "/v1/completions", headers=auth, timeout=10,
                   json={"model": "tiny", "prompt": "x", "max_tokens": 1})
    assert r.status_code == 200, r.text
    with log.open("rb") as f:
        f.seek(before)
        new = f.read().decode(errors="replace")
    assert "Traceback" not in new and "ERROR" not in new, new[-3000:]
