"""`lockgate bench flood`'s verdicts: the targets are judged on the best p99 of each side's
repeats and on every status the victim got in any of them."""

from __future__ import annotations

from collections import Counter

from lockgate.loadtests.bench_flood import SideRun, summarize


def side(ttft: list[float], **victim: int) -> SideRun:
    return SideRun(ttft=ttft, victim=Counter({k.lstrip("s"): v for k, v in victim.items()}))


def test_targets_are_met_on_the_best_repeat_and_every_503_counts():
    alone = [side([0.01] * 10, s200=10), side([0.02] * 10, s200=10)]
    flood = [side([0.3] * 9 + [2.0], s200=10), side([0.4] * 10, s200=10)]
    bomb = [side([0.01] * 9 + [0.05], s200=10)]
    got = summarize({"alone": alone, "flood": flood, "bomb": bomb})
    assert got["flood"]["p99_s"] == 0.4 and got["flood"]["met"]
    assert got["bomb"]["vs_alone"] == 5.0 and not got["bomb"]["met"]     # 0.05 s against 0.01 s alone
    flood[1].victim["503"] += 1
    assert not summarize({"alone": alone, "flood": flood, "bomb": bomb})["flood"]["met"]
