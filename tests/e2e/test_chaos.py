"""The chaos test, scaled down for CI: the gateway's reliability promises hold through a killed
replica, a hung Redis, a stopped database, a Redis restarted empty and all of them at once.
150 requests with client-side ids, a third each on chat completions, the Responses API and
the Messages API, streamed or not, a fifth of the streams left by the client part way (more
requests, at the same pace, while a slow restart keeps the faults going) over two `lockgate
serve` replicas on a PostgreSQL and a redis-server of the run's own, while the driver (one
fault at a time, see `loadtests/harness/chaos_faults.py`) kills a replica with SIGKILL once
(under load: once it holds a lease and a stream of every route is under way on it), hangs
Redis for 1.5 s, stops the database for 2 s, kills Redis and starts it again empty, then
overlaps: the database down, Redis hung, a replica killed, all cleared within 3 s (the
replica restarted on its data directory, replaying its spool). Lease ttl 3 s (heartbeat 1
s). The full 1,000-request run is `lockgate bench chaos`.

The run happens once (module fixture, about 60 s); each test asserts one promise on it:

- every attempt answered 200 (JSON, or a stream to its last event) has exactly one usage row,
  "ok", with the tokens the client was told; every other attempt at most one; no row
  invented: over the run and on each route alone, a stream the client left with its row too;
- the kill cut a stream of every route mid-way: each at most one row, its admission settled
  or refunded;
- each killed replica's leases are released within lease_ttl + one heartbeat, from the
  limiter's state on Redis's clock (`loadtests/harness/chaos_checks.py` says why that is
  sound), and its reservations are reconciled within that bound too;
- each tenant's day counter equals the tokens of its usage rows;
- each fault was injected under load, and a 200 came after each.

The first test checks the row checker itself on made-up attempts and rows, so the chaos
test can fail.
"""

from __future__ import annotations

import asyncio
import json
import os

import httpx
import pytest

from lockgate.loadtests.chaos import ChaosConfig, ChaosResult, format_report, run_chaos
from lockgate.loadtests.harness import chaos_routes
from lockgate.loadtests.harness.chaos_checks import Row, check_rows
from lockgate.loadtests.harness.chaos_client import Attempt
from lockgate.loadtests.harness.chaos_routes import ROUTES
from lockgate.loadtests.harness.services import ServiceUnavailable

CONFIG = ChaosConfig(
    num_requests=150, kills=1, redis_hang_s=1.5, db_stop_s=2.0, redis_restarts=1, overlap_s=3.0,
    duration_s=30.0,
    concurrency=8, lease_ttl_s=3.0, tenants=3, tenant_concurrency=2,
    max_tokens=(16, 64, 128, 256),      # long enough that a kill finds requests in flight
    warmup_s=3.0, tail_s=4.0, leave_fraction=0.2,
)
# The reconciler runs once per heartbeat on each replica; the sampler that sees an admission
# leave the pending index reads every 0.25 s, and a replica under this load may be a beat
# late: the promise's bound (ttl + heartbeat) plus this much, on Redis's clock.
RECONCILE_SLACK_S = 1.0


@pytest.fixture(scope="module")
def chaos(tmp_path_factory) -> ChaosResult:
    try:
        result = asyncio.run(run_chaos(CONFIG, tmp_path_factory.mktemp("chaos")))
    except ServiceUnavailable as exc:
        if os.environ.get("CI", "").lower() in ("1", "true", "yes"):
            pytest.fail(str(exc), pytrace=False)
        pytest.skip(str(exc))
    print("\n".join(format_report(result)))      # shown with -s, and on a failure
    return result


def test_row_checker_finds_lost_duplicated_invented_and_mismatched_rows():
    def attempt(cid: str, outcome: str, usage=(5, 7)) -> Attempt:
        return Attempt(0, 0, cid, 0, 0, False, 0.0, 1.0, 200, outcome, None, usage)

    def row(cid: str | None, status: str = "ok", tokens=(5, 7)) -> Row:
        return Row(cid, f"srv-{cid}-{status}-{tokens}", "ten_1", status, *tokens)

    attempts = [attempt("a", "ok"), attempt("b", "ok"), attempt("c", "ok"), attempt("d", "cut"),
                attempt("e", "cut"), attempt("f", "ok")]
    rows = [row("a"), row("c"), row("c", "cancelled"), row("d", "cancelled"),
            row("f", tokens=(5, 6)), row("zzz"), row(None)]
    report = check_rows(attempts, rows)
    assert (report.lost, report.duplicated, report.invented, report.mismatched) == (1, 1, 2, 1)
    assert report.by_outcome["cut"] == {"attempts": 2, "with_row": 1, "row_statuses": {"cancelled": 1}}
    assert not report.ok
    clean = check_rows(attempts[:1] + attempts[3:5], [row("a"), row("d", "cancelled")])
    assert clean.ok, clean.examples
    # a stream the client left has its row, unless its replica was killed just after
    left = attempt("g", "left")
    assert check_rows([left], []).lost == 1
    assert check_rows([left], [row("g", "cancelled")]).ok
    killed = check_rows([left], [], kills=[(0, 1.5)])
    assert killed.ok and killed.left_unwritten == 1


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_every_200_has_exactly_one_row(chaos: ChaosResult, route: str):
    rows = chaos.by_route[route]
    assert rows.ok_attempts >= CONFIG.num_requests // 10, "too few 200s on the route for the check to mean much"
    assert (rows.lost, rows.duplicated, rows.mismatched) == (0, 0, 0), rows.examples
    assert rows.by_outcome["ok"]["with_row"] == rows.ok_attempts
    mine = [a for a in chaos.attempts if a.route == route]
    assert any(a.stream and a.outcome == "ok" for a in mine) and any(not a.stream and a.outcome == "ok" for a in mine)
    assert "left" in rows.by_outcome, "no stream of the route was left by its client"


def test_the_kill_cut_a_stream_of_every_route_leaving_one_row_at_most_and_its_reservation_settled(
        chaos: ChaosResult):
    assert len(chaos.killed) == CONFIG.kills
    for cut in chaos.killed:
        assert sorted(cut) == sorted(ROUTES), cut
        for route, c in cut.items():
            assert c["cut"] >= 1 and c["max_rows"] <= 1, (route, c)
            assert c["settled"] == c["mid_stream"], (route, c)      # settled to its row or refunded
    assert chaos.killed_ok


def test_every_200_has_exactly_one_row_and_no_row_is_invented(chaos: ChaosResult):
    rows = chaos.rows
    assert rows.ok_attempts >= CONFIG.num_requests // 2, "too few 200s for the check to mean much"
    assert rows.lost == 0, rows.examples
    assert rows.duplicated == 0, rows.examples
    assert rows.invented == 0, rows.examples
    assert rows.mismatched == 0, rows.examples
    assert rows.by_outcome["ok"]["with_row"] == rows.ok_attempts
    # the faults did cut or refuse attempts: the "at most one row" side was exercised
    assert sum(c["attempts"] for o, c in rows.by_outcome.items() if o != "ok") > 0


def test_killed_replica_leases_released_within_ttl_plus_heartbeat(chaos: ChaosResult):
    leases = chaos.leases
    bound = CONFIG.lease_ttl_s + CONFIG.heartbeat_s
    kinds = [f.kind for f in chaos.faults if f.kind in ("kill", "overlap")]
    assert len(leases.kills) == len(kinds) == CONFIG.kills + 1       # the overlap kills one too
    for kind, k in zip(kinds, leases.kills, strict=True):
        # a plain kill waits for a lease; the overlap's requests may all have ended in the hang
        if kind == "kill":
            assert k["leases"] >= 1, "the kill found no lease of the replica: nothing was checked"
        assert k["over_bound"] == 0, k
        assert not k["leases"] or k["max_expiry_after_kill_s"] <= bound, k
    # once Redis's clock is past every kill + ttl + heartbeat, no scope holds a live lease
    assert leases.checked_after_last_kill_s > bound
    assert leases.live_after_deadline == {}
    assert leases.ok


def test_killed_replica_reservations_reconciled_within_the_bound(chaos: ChaosResult):
    bound = CONFIG.lease_ttl_s + CONFIG.heartbeat_s + RECONCILE_SLACK_S
    for k in chaos.leases.kills:
        assert k["unreconciled"] == 0, k
        assert not k["leases"] or k["reconciled_after_kill_s"] <= bound, k


def test_budgets_equal_the_sum_of_usage_rows(chaos: ChaosResult):
    # Needs the lease reconciler (gateway/reconciler.py, 8b13fd7): without it a killed
    # replica's reservations stay on the day counters and this fails. Needs the day counters
    # rebuilt from the rows once Redis is back empty (the Redis restart), and a spooled row
    # replayed after its reservation was refunded charged again (the overlap). Not xfailed
    # on purpose.
    for tenant, b in chaos.budgets.items():
        assert b["gap"] == 0, (tenant, b)
    assert all(b["rows"] > 0 for b in chaos.budgets.values())
    # the tight tenant ran out of budget: the limiter's budget state was in play
    assert any(a.error_code == "insufficient_quota" for a in chaos.attempts)


def test_each_fault_injected_under_load_and_recovered(chaos: ChaosResult):
    assert [f.kind for f in chaos.faults] == ["kill", "redis_hang", "db_stop", "redis_restart", "overlap"]
    assert chaos.notes == []                      # every fault began while requests were sent
    for f in chaos.faults:
        assert f.started < f.ended
    for a, b in zip(chaos.faults, chaos.faults[1:], strict=False):
        assert a.ended <= b.started               # one fault at a time
    # a 200 came after every fault ended (the figure itself is reported, not bounded)
    assert all(r is not None for r in chaos.recoveries()), chaos.recoveries()
    outcomes = {a.outcome for a in chaos.attempts}
    assert "unreachable" in outcomes or "cut" in outcomes        # the kill was felt
    assert any(a.error_code == "limiter_unavailable" for a in chaos.attempts)   # the hang was
    overlap = chaos.faults[-1]
    assert overlap.started < overlap.ended < overlap.ready      # cleared, then its replica restarted


def _sse(*events: dict | str) -> bytes:
    return b"".join(b"data: " + (e if isinstance(e, str) else json.dumps(e)).encode() + b"\n\n" for e in events)


STREAMS = {   # route -> (a stream to its last event, its server id, (prompt, completion))
    "chat": (_sse({"id": "chatcmpl-s1", "choices": [{"delta": {"content": "a"}}]},
                  {"id": "chatcmpl-s1", "choices": [{"delta": {"content": "b"}}]},
                  {"id": "chatcmpl-s1", "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}},
                  "[DONE]"), "s1", (5, 2)),
    "responses": (_sse({"type": "response.created", "response": {"id": "resp_s2"}},
                       {"type": "response.output_text.delta", "delta": "a"},
                       {"type": "response.output_text.delta", "delta": "b"},
                       {"type": "response.completed",
                        "response": {"id": "resp_s2", "usage": {"input_tokens": 5, "output_tokens": 2}}}),
                  "s2", (5, 2)),
    "messages": (_sse({"type": "message_start", "message": {"id": "msg_s3"}},
                      {"type": "content_block_delta", "delta": {"text": "a"}},
                      {"type": "content_block_delta", "delta": {"text": "b"}},
                      {"type": "message_delta", "usage": {"input_tokens": 3, "cache_read_input_tokens": 2,
                                                          "output_tokens": 2}},
                      {"type": "message_stop"}), "s3", (5, 2)),
}


@pytest.mark.parametrize("route", ROUTES)
def test_each_routes_stream_is_read_to_its_last_event(route: str):
    """The client's reading of each route's stream: "ok" only at its last event, with the
    tokens and the server's id; "cut" without it; "left" when it leaves on purpose."""
    body, sid, usage = STREAMS[route]

    async def one(content: bytes, leave_after: int = 0) -> Attempt:
        transport = httpx.MockTransport(lambda request: httpx.Response(200, content=content))
        a = Attempt(0, 0, "c", 0, 0, True, 0.0, route=route, leave_after=leave_after)
        async with httpx.AsyncClient(transport=transport) as client:
            await chaos_routes.send(route, client, "http://x", "k", chaos_routes.body(route, True, 8, 0), a, 5.0)
        return a

    whole = asyncio.run(one(body))
    assert (whole.outcome, whole.server_id, whole.usage, whole.deltas) == ("ok", sid, usage, 2)
    last = body.rstrip(b"\n").rsplit(b"\n\n", 1)[0] + b"\n\n"
    assert asyncio.run(one(last)).outcome == "cut"
    assert asyncio.run(one(body, leave_after=1)).outcome == "left"
