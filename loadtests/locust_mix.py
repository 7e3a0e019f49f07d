"""The multi-tenant locust suite that `lockgate loadtest` runs: four kinds of user, each a
locust user class, against a live gateway.

- `OnlineChatUser`: a person chatting (`service_tier` default), streamed; the time to the
  first content chunk (request type `TTFT`) and each gap between content chunks (`ITL`) are
  locust entries of their own beside the stream's time to its end.
- `OfflineUser`: offline work (`flex`) with long prompts, streamed and not, in turns.
- `BatchSubmitter`: OpenAI's Batch API: upload a JSONL file, create a batch, poll it until
  it ends, download its output.
- `MisbehavingUser`: a bad key (401), a tenant over its request rate (429), a body over the
  gateway's limit (413). The expected refusal counts as a success, under its own name.

A well-behaved user's 429 or 503 (a limit, or the engine shedding load) is a refusal, not a
failure, and is counted under its own name (`online chat (429)`); anything else that is not
a well-formed answer is a failure. Every request runs to its end: locust is given a stop
timeout, so no stream is cut and the tokens the clients received can be compared with what
the gateway's usage report bills.

Configured by `lockgate loadtest` through `LOCKGATE_LOADTEST` (JSON, `loadtest_setup.Plan`):
the model, each class's users (tenant and key), request sizes and the folder each process
writes its per-request samples to (`samples-<pid>.jsonl`, one JSON object a line: what the
summary and the plots are made of).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import time
from collections import defaultdict
from itertools import count, pairwise
from typing import Any

from locust import FastHttpUser, between, events, task

from lockgate.loadtests.loadtest_batch import TERMINAL_BATCH, collect_batch
from lockgate.loadtests.sse import read_sse

CONFIG: dict[str, Any] = json.loads(os.environ.get("LOCKGATE_LOADTEST", "{}"))
WORDS = ("river", "stone", "cloud", "harbour", "lantern", "meadow", "copper", "signal", "garden",
         "winter", "orbit", "thread", "candle", "marble", "forest", "engine", "ladder", "violet")
_samples: Any = None
_spawned: defaultdict[str, count] = defaultdict(count)     # users started, per class


@events.test_start.add_listener
def _open_samples(environment, **_kwargs) -> None:
    global _samples
    if not CONFIG:
        raise SystemExit("locust_mix: run it through `lockgate loadtest` (LOCKGATE_LOADTEST is not set)")
    path = os.path.join(CONFIG["samples_dir"], f"samples-{os.getpid()}.jsonl")
    _samples = open(path, "a", buffering=1, encoding="utf-8")    # noqa: SIM115 - open for the run


def record(cls: str, tenant: str, name: str, status: int, outcome: str, start: float, **fields) -> None:
    """One request's sample: outcome is ok, expected (a refusal the user asked for), refused
    (a well-behaved request's 429 or 503) or failed; `created` marks a batch's creation."""
    if _samples is not None:
        _samples.write(json.dumps({"t": time.time(), "start": start, "cls": cls, "tenant": tenant,
                                   "name": name, "status": status, "outcome": outcome, **fields}) + "\n")


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


class GatewayUser(FastHttpUser):
    """A user of one tenant: the class's next assignment (tenant, key) in spawn order."""

    abstract = True
    cls = ""
    network_timeout = 300.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        users = CONFIG["users"][self.cls]
        self.index = next(_spawned[self.cls])
        me = users[self.index % len(users)]
        self.tenant, self.key = me["tenant"], me["key"]
        self.headers = {"Authorization": f"Bearer {self.key}", "Content-Type": "application/json"}
        self.model = CONFIG["model"]
        self.rng = random.Random(secrets.randbits(32))

    def record(self, name: str, status: int, outcome: str, start: float, **fields) -> None:
        fields.setdefault("tenant", self.tenant)
        record(self.cls, name=name, status=status, outcome=outcome, start=start,
               user=f"{self.cls}-{self.index}", **fields)

    def refused(self, r, name: str, start: float) -> bool:
        """A 429 or 503 answer: counted as a refusal under its own name."""
        if r.status_code not in (429, 503):
            return False
        _ = r.content                      # read it: the connection goes back to the pool
        r.success()
        r.request_meta["name"] = f"{name} ({r.status_code})"
        self.record(name, r.status_code, "refused", start)
        return True

    def stream_chat(self, name: str, body: dict) -> None:
        start, t0 = time.time(), time.perf_counter()
        body = {**body, "model": self.model, "stream": True, "stream_options": {"include_usage": True}}
        with self.client.post("/v1/chat/completions", data=json.dumps(body), headers=self.headers,
                              name=name, stream=True, catch_response=True) as r:
            if self.refused(r, name, start):
                return
            if r.status_code != 200:
                r.failure(f"{r.status_code}: {r.text[:200]}")
                self.record(name, r.status_code, "failed", start, error=r.text[:200])
                return
            times, usage, error, done = read_sse(r)
            r.request_meta["response_time"] = (time.perf_counter() - t0) * 1000     # to the end
            problem = (f"error event: {error}" if error is not None else
                       "no [DONE]" if not done else "no usage chunk" if usage is None else None)
            if problem:
                r.failure(problem)
        ttft = (times[0] - t0) * 1000 if times else None
        gaps = [(b - a) * 1000 for a, b in pairwise(times)]
        if ttft is not None:
            events.request.fire(request_type="TTFT", name=name, response_time=ttft,
                                response_length=0, exception=None, context={})
        for gap in gaps:
            events.request.fire(request_type="ITL", name=name, response_time=gap,
                                response_length=0, exception=None, context={})
        usage = usage or {}
        n = usage.get("completion_tokens", 0)
        tpot = (times[-1] - times[0]) * 1000 / (n - 1) if len(times) > 1 and n > 1 else None
        self.record(name, 200, "failed" if problem else "ok", start,
                    ttft_ms=ttft, tpot_ms=tpot, itl_ms=[round(g, 2) for g in gaps],
                    prompt_tokens=usage.get("prompt_tokens", 0), completion_tokens=n, error=problem)

    def post_chat(self, name: str, body: dict) -> None:
        start = time.time()
        with self.client.post("/v1/chat/completions", data=json.dumps({**body, "model": self.model}),
                              headers=self.headers, name=name, catch_response=True) as r:
            if self.refused(r, name, start):
                return
            usage, problem = {}, None
            if r.status_code != 200:
                problem = f"{r.status_code}: {r.text[:200]}"
            else:
                try:
                    data = r.json()
                    usage = data["usage"]
                    if data.get("object") != "chat.completion" or not data.get("choices"):
                        problem = f"unexpected body: {r.text[:200]}"
                except (ValueError, KeyError, TypeError):
                    problem = f"no usage in the body: {r.text[:200]}"
            if problem:
                r.failure(problem)
        self.record(name, r.status_code, "failed" if problem else "ok", start,
                    prompt_tokens=usage.get("prompt_tokens", 0),
                    completion_tokens=usage.get("completion_tokens", 0), error=problem)


class OnlineChatUser(GatewayUser):
    """A person chatting: short prompts, streamed, `service_tier` default."""

    cls = "online"
    wait_time = between(0.5, 2.0)

    @task
    def chat(self) -> None:
        self.stream_chat("online chat", {
            "service_tier": "default", "max_tokens": CONFIG["max_tokens"],
            "messages": [{"role": "system", "content": "You are brief."},
                         {"role": "user", "content": words(self.rng, 12)}],
        })


class OfflineUser(GatewayUser):
    """Offline work on the flex tier: long prompts, longer answers, streamed and not in turns."""

    cls = "offline"
    wait_time = between(0.2, 1.0)

    def _body(self) -> dict:
        return {"service_tier": "flex", "max_tokens": CONFIG["offline_max_tokens"],
                "messages": [{"role": "user", "content": "Summarise: "
                              + words(self.rng, CONFIG["offline_prompt_words"])}]}

    @task
    def summarise_streamed(self) -> None:
        self.stream_chat("offline chat", self._body())

    @task
    def summarise(self) -> None:
        self.post_chat("offline chat (whole)", self._body())


class BatchSubmitter(GatewayUser):
    """A batch job at a time: upload, create, poll until it ends, download (OpenAI's shapes)."""

    cls = "batch"
    wait_time = between(1.0, 3.0)

    def _lines(self) -> bytes:
        tag = secrets.token_hex(4)
        return b"".join(json.dumps({
            "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": self.model, "max_tokens": CONFIG["max_tokens"],
                     "messages": [{"role": "user", "content": words(self.rng, 40)}]},
        }).encode() + b"\n" for i in range(CONFIG["batch_lines"]))

    def _json(self, r, what: str) -> dict | None:
        if r.status_code != 200:
            r.failure(f"{what}: {r.status_code} {r.text[:200]}")
            return None
        try:
            return r.json()
        except ValueError:
            r.failure(f"{what}: not JSON")
            return None

    def _upload(self) -> dict | None:
        boundary = "lockgate-" + secrets.token_hex(8)
        body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
                f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"lines.jsonl\"\r\n"
                "Content-Type: application/jsonl\r\n\r\n").encode() + self._lines() + f"\r\n--{boundary}--\r\n".encode()
        headers = {"Authorization": f"Bearer {self.key}",
                   "Content-Type": f"multipart/form-data; boundary={boundary}"}
        with self.client.post("/v1/files", data=body, headers=headers, name="batch upload",
                              catch_response=True) as r:
            return self._json(r, "upload")

    def _request_json(self, method: str, path: str, name: str, body: dict | None = None) -> dict | None:
        with self.client.request(method, path, data=json.dumps(body) if body else None,
                                 headers=self.headers, name=name, catch_response=True) as r:
            return self._json(r, name)

    @task
    def submit(self) -> None:
        start = time.time()
        upload = self._upload()
        batch = upload and self._request_json("POST", "/v1/batches", "batch create", {
            "input_file_id": upload["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"})
        if not batch:
            self.record("batch job", 0, "failed", start, error="upload or create failed")
            return
        self.record("batch created", 200, "created", start, batch_id=batch["id"])
        deadline = time.monotonic() + CONFIG["batch_timeout_s"]
        while batch["status"] not in TERMINAL_BATCH and time.monotonic() < deadline:
            time.sleep(CONFIG["batch_poll_s"])
            batch = self._request_json("GET", f"/v1/batches/{batch['id']}", "batch poll") or batch
        result = collect_batch(batch, lambda path: self._download(path))
        events.request.fire(request_type="BATCH", name="batch turnaround", context={},
                            response_time=(time.time() - start) * 1000, response_length=0,
                            exception=None if result["outcome"] == "ok" else Exception(result["error"]))
        self.record("batch job", 200, start=start, batch_id=batch["id"], **result)

    def _download(self, path: str) -> bytes | None:
        with self.client.get(path, headers=self.headers, name="batch download", catch_response=True) as r:
            if r.status_code != 200:
                r.failure(f"download: {r.status_code} {r.text[:200]}")
                return None
            return r.content


class MisbehavingUser(GatewayUser):
    """Requests that must be refused: each refusal with the expected status is a success. Its
    tenant's request rate is tiny: the few requests within it are answered, and billed."""

    cls = "bad"
    wait_time = between(0.5, 1.5)

    def _expect(self, name: str, expected: int, key: str, data: bytes, tenant: str) -> None:
        start = time.time()
        headers = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        with self.client.post("/v1/chat/completions", data=data, headers=headers,
                              name=f"{name} ({expected})", catch_response=True) as r:
            usage, outcome = {}, "failed"
            if r.status_code == expected:
                outcome = "expected"
                r.success()
            elif r.status_code == 200 and expected == 429:      # within the allowance: billed
                usage = r.json().get("usage") or {}
                outcome = "ok"
                r.success()
                r.request_meta["name"] = f"{name} (admitted)"
            else:
                r.failure(f"expected {expected}, got {r.status_code}: {r.text[:200]}")
        self.record(name, r.status_code, outcome, start, tenant=tenant,
                    prompt_tokens=usage.get("prompt_tokens", 0),
                    completion_tokens=usage.get("completion_tokens", 0),
                    error=None if outcome != "failed" else f"expected {expected}, got {r.status_code}")

    def _chat(self) -> bytes:
        return json.dumps({"model": self.model, "max_tokens": 4,
                           "messages": [{"role": "user", "content": words(self.rng, 6)}]}).encode()

    @task
    def bad_key(self) -> None:
        self._expect("bad key", 401, "lg-" + secrets.token_urlsafe(32), self._chat(), "(none)")

    @task
    def over_quota(self) -> None:
        self._expect("over quota", 429, self.key, self._chat(), self.tenant)

    @task
    def oversized_body(self) -> None:
        filler = "x" * CONFIG["oversize_bytes"]
        body = json.dumps({"model": self.model, "messages": [{"role": "user", "content": filler}]})
        self._expect("oversized body", 413, self.key, body.encode(), self.tenant)


# as many users of each class as `lockgate loadtest` planned (it names the classes to run)
for _user_class in (OnlineChatUser, OfflineUser, BatchSubmitter, MisbehavingUser):
    _user_class.fixed_count = len(CONFIG.get("users", {}).get(_user_class.cls, ()))
