"""A locust suite against a live Lockgate gateway: tenants' users chatting (streamed and not)
and asking for completions, on the online (`default`) and flex tiers, with small, bounded
requests.

Needs locust: scripts/setup.sh installs it (the `test` extra), or `pip install -e '.[load]'`.
Configure with environment variables:

    LOCKGATE_KEY          a tenant's inference key (required), e.g. from
                          `POST /admin/v1/tenants/{id}/keys`
    LOCKGATE_MODEL        the model to call (default: the first of GET /v1/models)
    LOCKGATE_MAX_TOKENS   max_tokens of every request (default 16, capped at 64)
    LOCKGATE_REQUESTS_PER_USER   stop each user after this many requests (default: no cap);
                          a single-process run then ends when every user has stopped

Headless against a gateway on loopback, with a time limit (20 users, 5 started a second,
30 seconds, then locust prints its statistics and exits):

    LOCKGATE_KEY=lg-... locust -f loadtests/locustfile.py --headless -u 20 -r 5 -t 30s \\
        --host http://127.0.0.1:8000

Add `--csv out/lockgate` for CSV statistics, `--only-summary` for the final table alone.
A streamed request counts as a success only when its stream ended with `data: [DONE]` and
carried no error event; its response time is to the end of the stream, and the time to its
first content chunk is reported as a separate entry ("... TTFT"). Every request must be
answered by a 200 or a 429 (a limit; counted under its own name so the rate of refusals
shows); anything else is a failure.
"""

from __future__ import annotations

import json
import os
import time

from locust import FastHttpUser, between, events, task
from locust.exception import StopUser
from locust.runners import LocalRunner

from lockgate.loadtests.sse import read_sse

KEY = os.environ.get("LOCKGATE_KEY", "")
MAX_TOKENS = max(1, min(64, int(os.environ.get("LOCKGATE_MAX_TOKENS", "16"))))
REQUESTS_PER_USER = int(os.environ.get("LOCKGATE_REQUESTS_PER_USER", "0"))
PROMPTS = [
    "Write one sentence about the sea.",
    "List three colours.",
    "What is two plus two?",
    "Say hello in French.",
    "Name a prime number greater than ten.",
]


_finished_users: list[object] = []   # users that spent LOCKGATE_REQUESTS_PER_USER


@events.test_start.add_listener
def _check_key(environment, **_kwargs) -> None:
    if not KEY:
        raise SystemExit("locustfile: set LOCKGATE_KEY to a tenant's inference key")


class TenantUser(FastHttpUser):
    """One client of one tenant: mostly chat, some completions; mostly online, some flex."""

    wait_time = between(0.2, 1.0)
    network_timeout = 60.0
    connection_timeout = 10.0

    def on_start(self) -> None:
        self.headers = {"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}
        self.sent = 0
        self.model = os.environ.get("LOCKGATE_MODEL")
        if not self.model:
            with self.client.get("/v1/models", headers=self.headers, name="/v1/models",
                                 catch_response=True) as r:
                if r.status_code != 200 or not r.json().get("data"):
                    r.failure(f"GET /v1/models: {r.status_code} {r.text[:200]}")
                    raise StopUser()
                self.model = r.json()["data"][0]["id"]

    def _count(self) -> None:
        self.sent += 1
        if REQUESTS_PER_USER and self.sent > REQUESTS_PER_USER:
            _finished_users.append(self)
            runner = self.environment.runner
            # a single-process run ends once every user has spent its budget, not at -t
            if isinstance(runner, LocalRunner) and len(_finished_users) >= runner.target_user_count:
                runner.quit()
            raise StopUser()

    def _prompt(self) -> str:
        return PROMPTS[self.sent % len(PROMPTS)]

    def _not_answered(self, r, name: str) -> bool:
        """A 429 (a limit) counts as a success under its own name, any other status but 200
        as a failure: True for either, and the caller reads no further."""
        if r.status_code == 429:
            _ = r.content     # read it: a stream's connection goes back to the pool
            r.success()
            r.request_meta["name"] = f"{name} (429)"
            return True
        if r.status_code != 200:
            r.failure(f"{r.status_code}: {r.text[:200]}")
            return True
        return False

    # -- non-streaming ---------------------------------------------------------------------
    def _post(self, path: str, body: dict, name: str, expect_object: str) -> None:
        self._count()
        with self.client.post(path, data=json.dumps(body), headers=self.headers, name=name,
                              catch_response=True) as r:
            if self._not_answered(r, name):
                return
            try:
                data = r.json()
            except ValueError:
                r.failure("not JSON")
                return
            if data.get("object") != expect_object or not data.get("choices"):
                r.failure(f"unexpected body: {r.text[:200]}")
            elif not data.get("usage", {}).get("total_tokens"):
                r.failure("no usage in the response")

    def _body(self, tier: str, **fields) -> dict:
        """A request's body: this user's model, MAX_TOKENS, `tier`, then `fields`."""
        return {"model": self.model, "max_tokens": MAX_TOKENS, "service_tier": tier, **fields}

    @task(4)
    def chat_online(self) -> None:
        self._post("/v1/chat/completions", self._body("default", messages=[
            {"role": "user", "content": self._prompt()}]), "chat (online)", "chat.completion")

    @task(1)
    def chat_flex(self) -> None:
        self._post("/v1/chat/completions", self._body("flex", messages=[
            {"role": "system", "content": "Be brief."}, {"role": "user", "content": self._prompt()}]),
            "chat (flex)", "chat.completion")

    @task(2)
    def completion_online(self) -> None:
        self._post("/v1/completions", self._body("default", prompt=self._prompt()),
                   "completion (online)", "text_completion")

    @task(1)
    def completion_flex(self) -> None:
        self._post("/v1/completions", self._body("flex", prompt=self._prompt()),
                   "completion (flex)", "text_completion")

    # -- streaming ---------------------------------------------------------------------------
    def _stream(self, path: str, body: dict, name: str) -> None:
        self._count()
        t0 = time.perf_counter()
        first: float | None = None
        with self.client.post(path, data=json.dumps({**body, "stream": True,
                                                      "stream_options": {"include_usage": True}}),
                              headers=self.headers, name=name, stream=True,
                              catch_response=True) as r:
            if self._not_answered(r, name):
                return
            times, usage, error, done = read_sse(r)
            first = times[0] if times else None
            r.request_meta["response_time"] = (time.perf_counter() - t0) * 1000  # to the end
            if error is not None:
                r.failure(f"error event: {error}")
            elif not done:
                r.failure("the stream ended without [DONE]")
            elif usage is None:
                r.failure("no usage chunk")
        if first is not None:
            events.request.fire(request_type="SSE", name=f"{name} TTFT",
                                response_time=(first - t0) * 1000, response_length=0,
                                exception=None, context={})

    @task(2)
    def chat_stream_online(self) -> None:
        self._stream("/v1/chat/completions", self._body("default", messages=[
            {"role": "user", "content": self._prompt()}]), "chat stream (online)")

    @task(1)
    def completion_stream_flex(self) -> None:
        self._stream("/v1/completions", self._body("flex", prompt=self._prompt()),
                     "completion stream (flex)")
