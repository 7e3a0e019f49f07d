"""The arithmetic behind `lockgate loadtest`'s verdicts, on hand-made samples: Jain's index,
SLO attainment, the quota accounting error, how users are shared out, a batch's tokens."""

from __future__ import annotations

import json

import pytest

from lockgate.loadtests.loadtest import is_loopback, shown_command
from lockgate.loadtests.loadtest_batch import collect_batch
from lockgate.loadtests.loadtest_setup import (
    TENANTS,
    Tenant,
    largest_remainder,
    parse_mix,
    spread,
    users_per_class,
)
from lockgate.loadtests.loadtest_summary import (
    SloTargets,
    accounting,
    attainment,
    fairness,
    jain_index,
    online_beside_batches,
    received_tokens,
    summarize,
    to_markdown,
)


def sample(cls="online", outcome="ok", tenant="a", start=100.0, t=101.0, **fields):
    return {"cls": cls, "outcome": outcome, "tenant": tenant, "start": start, "t": t,
            "name": f"{cls} chat", "status": 200, **fields}


def test_jain_index_worked_examples():
    """(sum x)^2 / (n sum x^2): equal shares 1; one of four has it all 16/(4*16) = 1/4;
    [1, 2]: 9 / (2 * 5) = 0.9; nothing to judge: None."""
    assert jain_index([3.0, 3.0, 3.0, 3.0]) == pytest.approx(1.0)
    assert jain_index([4.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert jain_index([1.0, 2.0]) == pytest.approx(0.9)
    assert jain_index([]) is None
    assert jain_index([0.0, 0.0]) is None


def test_fairness_divides_throughput_by_weight_per_class():
    """Over 10 s, a and b (weight 1) 100 tokens each, c (weight 2) 200: 10, 10, 10 tokens/s
    per unit of weight, J = 1. Had c also got 100: 10, 10, 5 -> 25^2 / (3 * 225) = 0.926.
    A class with one tenant, the misbehaving class and tenants without users are left out."""
    tenants = [{"name": "a", "cls": "online", "weight": 1.0, "users": 1},
               {"name": "b", "cls": "online", "weight": 1.0, "users": 1},
               {"name": "c", "cls": "online", "weight": 2.0, "users": 2},
               {"name": "idle", "cls": "online", "weight": 1.0, "users": 0},
               {"name": "o", "cls": "offline", "weight": 1.0, "users": 3},
               {"name": "x", "cls": "bad", "weight": 1.0, "users": 1},
               {"name": "y", "cls": "bad", "weight": 1.0, "users": 1}]
    fair = fairness(tenants, {"a": 100, "b": 100, "c": 200, "o": 50, "x": 1}, 10.0)
    assert set(fair) == {"online"}
    assert fair["online"]["jain"] == pytest.approx(1.0)
    assert fair["online"]["tokens_per_s_per_weight"] == {"a": 10.0, "b": 10.0, "c": 10.0}
    assert fair["online"]["users_proportional"]              # 1, 1, 2 users for weights 1, 1, 2
    unfair = fairness(tenants, {"a": 100, "b": 100, "c": 100}, 10.0)
    assert unfair["online"]["jain"] == pytest.approx(625 / 675)


def test_attainment_counts_every_request_and_only_those_meeting_the_target():
    t = SloTargets(online_ttft_ms=1000, online_tpot_ms=100, batch_turnaround_s=60)
    online = [sample(ttft_ms=500, tpot_ms=50),                  # meets
              sample(ttft_ms=1500, tpot_ms=50),                 # TTFT over
              sample(ttft_ms=200, tpot_ms=150),                 # TPOT over
              sample(ttft_ms=10, tpot_ms=None),                 # one token: TTFT alone
              sample(outcome="refused"),                        # a 429 never meets
              sample(outcome="failed", ttft_ms=10)]
    assert attainment(online, t) == pytest.approx(2 / 6)
    offline = [sample("offline"), sample("offline", "refused"), sample("offline", "failed")]
    assert attainment(offline, t) == pytest.approx(1 / 3)
    batch = [sample("batch", start=0.0, t=59.0), sample("batch", start=0.0, t=61.0)]
    assert attainment(batch, t) == pytest.approx(0.5)
    bad = [sample("bad", "expected"), sample("bad", "ok"), sample("bad", "failed"), sample("bad", "expected")]
    assert attainment(bad, t) == pytest.approx(3 / 4)
    assert attainment([], t) is None


def test_accounting_error_sums_absolute_differences_per_tenant():
    """a: billed what it received (0); b: billed 2 completion tokens more than received and
    1 prompt token fewer (3); c: received 4 that were never billed (4). Total 7: an
    over-bill does not cancel an under-bill."""
    billed = {"a": {"prompt_tokens": 10, "completion_tokens": 5},
              "b": {"prompt_tokens": 3, "completion_tokens": 4}}
    received = {"a": {"prompt_tokens": 10, "completion_tokens": 5},
                "b": {"prompt_tokens": 4, "completion_tokens": 2},
                "c": {"prompt_tokens": 0, "completion_tokens": 4}}
    books = accounting(billed, received)
    assert {k: v["error_tokens"] for k, v in books["tenants"].items()} == {"a": 0, "b": 3, "c": 4}
    assert books["error_tokens"] == 7
    assert accounting(billed, {k: dict(v) for k, v in billed.items()})["error_tokens"] == 0


def test_received_tokens_sum_every_answer_but_not_batch_creation_marks():
    samples = [sample(prompt_tokens=7, completion_tokens=3),
               sample(outcome="failed", prompt_tokens=2, completion_tokens=None),
               sample(outcome="refused"),
               sample("batch", outcome="created", tenant="a", prompt_tokens=100),
               sample("batch", tenant="b", prompt_tokens=20, completion_tokens=8)]
    assert received_tokens(samples) == {"a": {"prompt_tokens": 9, "completion_tokens": 3},
                                        "b": {"prompt_tokens": 20, "completion_tokens": 8}}


def test_summary_verdicts_fail_on_a_failure_or_a_billing_gap():
    tenants = [{"name": "a", "cls": "online", "weight": 1.0, "users": 1},
               {"name": "b", "cls": "online", "weight": 1.0, "users": 1}]
    samples = [sample(tenant="a", ttft_ms=5, prompt_tokens=4, completion_tokens=2),
               sample(tenant="b", ttft_ms=5, prompt_tokens=4, completion_tokens=2)]
    billed = {"a": {"prompt_tokens": 4, "completion_tokens": 2}, "b": {"prompt_tokens": 4, "completion_tokens": 2}}
    run = {"users": 2, "mix": "online=1"}
    good = summarize(samples, tenants, billed, duration_s=2.0, targets=SloTargets(), run=run)
    assert good["passed"] and good["unexpected_failures"] == 0
    assert good["classes"]["online"]["output_tokens_per_s"] == pytest.approx(2.0)
    assert good["fairness"]["online"]["jain"] == pytest.approx(1.0)
    assert "| online | 2 | 2 | 2 |" in to_markdown(good)
    gap = summarize(samples, tenants, {**billed, "b": {"prompt_tokens": 4, "completion_tokens": 3}},
                    duration_s=2.0, targets=SloTargets(), run=run)
    assert not gap["passed"] and gap["accounting"]["error_tokens"] == 1
    failed = summarize([*samples, sample(tenant="a", outcome="failed", error="500")], tenants, billed,
                       duration_s=2.0, targets=SloTargets(), run=run)
    assert not failed["passed"] and failed["unexpected_failures"] == 1


def test_users_are_shared_by_largest_remainder():
    """8 users, 0.5/0.2/0.1/0.2: exact 4, 1.6, 0.8, 1.6 -> floors 4, 1, 0, 1, the two largest
    remainders (batch 0.8, then offline 0.6 before bad 0.6) one more each."""
    assert users_per_class(8, parse_mix("online=0.5,offline=0.2,batch=0.1,bad=0.2")) == \
        {"online": 4, "offline": 2, "batch": 1, "bad": 1}
    assert largest_remainder(4, [1, 1, 2]) == [1, 1, 2]
    assert largest_remainder(5, [1, 1, 2]) == [1, 1, 3]
    # a class with a share gets a user, taken from the largest
    assert users_per_class(4, parse_mix("online=97,offline=1,batch=1,bad=1")) == \
        {"online": 1, "offline": 1, "batch": 1, "bad": 1}
    assert users_per_class(3, parse_mix("online=1")) == {"online": 3, "offline": 0, "batch": 0, "bad": 0}
    with pytest.raises(ValueError, match="at least one"):
        users_per_class(2, parse_mix("online=1,offline=1,bad=1"))
    for bad_mix in ("online", "web=1", "online=-1", "online=0", "online=x"):
        with pytest.raises(ValueError):
            parse_mix(bad_mix)


def test_spread_interleaves_users_by_weight():
    online = [Tenant(spec, spec.label, spec.label, "k") for spec in TENANTS if spec.cls == "online"]
    order = spread(online, 4)
    assert [t.name for t in order] == ["online-a", "online-b", "online-c", "online-c"]
    assert [t.num_users for t in online] == [1, 1, 2]


def test_collect_batch_sums_the_output_and_error_files():
    out = [{"id": "r1", "custom_id": "x-0", "error": None, "response": {
               "status_code": 200, "body": {"usage": {"prompt_tokens": 11, "completion_tokens": 4}}}},
           {"id": "r2", "custom_id": "x-1", "error": None, "response": {
               "status_code": 200, "body": {"usage": {"prompt_tokens": 9, "completion_tokens": 4}}}}]
    err = [{"id": "r3", "custom_id": "x-2", "response": None,
            "error": {"code": "engine_overloaded", "message": "busy"}}]
    files = {"/v1/files/out/content": b"".join(json.dumps(x).encode() + b"\n" for x in out),
             "/v1/files/err/content": json.dumps(err[0]).encode() + b"\n"}
    done = collect_batch({"status": "completed", "output_file_id": "out"}, files.get)
    assert done == {"outcome": "ok", "lines": 2, "lines_ok": 2, "prompt_tokens": 20,
                    "completion_tokens": 8, "error": None}
    partial = collect_batch({"status": "completed", "output_file_id": "out", "error_file_id": "err"}, files.get)
    assert partial["outcome"] == "failed" and partial["lines_ok"] == 2 and partial["lines"] == 3
    assert collect_batch({"status": "in_progress"}, files.get)["outcome"] == "failed"


def test_loopback_only_and_no_key_in_the_shown_command():
    assert is_loopback("http://127.0.0.1:8000") and is_loopback("http://localhost:1")
    assert is_loopback("http://[::1]:8000") and is_loopback("http://127.8.0.1")
    assert not is_loopback("http://10.0.0.1:8000") and not is_loopback("http://example.com")
    assert shown_command(["--users", "8", "--admin-key", "lg-secret", "--admin-key=lg-x", "--out", "o"]) \
        == "lockgate loadtest --users 8 --out o"


def test_plot_bins_spread_tokens_over_the_time_they_were_produced():
    """10 s in 2 s bins. A stream started at 0.5 s, first token at 1 s, ended at 5 s, 8 tokens:
    1 s of its 4 in bin 0 (2 tokens), 2 s in bin 1 (4), 1 s in bin 2 (2); per second, halved.
    A whole answer of 3 tokens that took no time counts all in its bin."""
    from lockgate.loadtests.loadtest_plots import Bins

    bins = Bins(100.0, 10.0)
    assert (bins.width, bins.num) == (2.0, 5)
    stream = sample(start=100.5, t=105.0, ttft_ms=500, completion_tokens=8)
    assert bins.token_rate([stream]) == pytest.approx([1.0, 2.0, 1.0, 0.0, 0.0])
    instant = sample(start=107.0, t=107.0, completion_tokens=3)
    assert bins.token_rate([instant]) == pytest.approx([0.0, 0.0, 0.0, 1.5, 0.0])
    assert bins.rate([stream, instant]) == pytest.approx([0.0, 0.0, 0.5, 0.5, 0.0])


def test_online_ttft_is_split_by_whether_a_batch_job_was_in_flight():
    samples = [
        {"cls": "batch", "name": "batch job", "tenant": "b", "outcome": "ok", "start": 10.0, "t": 20.0},
        {"cls": "batch", "name": "batch created", "tenant": "b", "outcome": "created", "start": 30.0, "t": 90.0},
        *({"cls": "online", "name": "online chat", "tenant": "o", "outcome": "ok", "start": st, "t": st + 1,
           "ttft_ms": ttft} for st, ttft in ((5.0, 10.0), (10.0, 40.0), (15.0, 30.0), (20.0, 50.0), (25.0, 20.0),
                                             (35.0, 12.0))),
        {"cls": "online", "name": "online chat", "tenant": "o", "outcome": "refused", "start": 12.0, "t": 12.1},
    ]
    got = online_beside_batches(samples)
    assert got["batch_jobs"] == 1                     # a creation mark is not a job's span
    assert got["during"] == {"p50": 40.0, "p99": 50.0, "n": 3}          # sent at 10, 15 and 20 s
    assert got["outside"] == {"p50": 12.0, "p99": 20.0, "n": 3}         # at 5, 25 and 35 s
