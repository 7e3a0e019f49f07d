"""`lockgate bench console` at a small size: every page answers 200, its row of the table
printed with its SQL statements and times, the scratch database dropped afterwards."""

from __future__ import annotations

import re

from typer.testing import CliRunner

from lockgate.loadtests.bench_console import PAGES
from lockgate.loadtests.cli import bench_app
from tests.support.services import _pg_admin


def _databases() -> set[str]:
    with _pg_admin() as conn:
        return {r[0] for r in conn.execute("SELECT datname FROM pg_database").fetchall()}


def test_bench_console_smoke_prints_every_page():
    before = _databases()
    res = CliRunner().invoke(bench_app, ["console", "--rows", "300", "--repeats", "3"])
    assert res.exit_code == 0, res.output
    assert "300 usage rows inserted" in res.output and "target p95 < 300 ms" in res.output
    for name, _ in PAGES:
        row = re.search(rf"^{re.escape(name)}\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+yes$", res.output, re.M)
        assert row and row.group(1) == "200" and int(row.group(2)) > 0, (name, res.output)
    assert not {d for d in _databases() - before if d.startswith("lg_bench_console_")}


def test_bench_console_refuses_an_unreachable_database():
    res = CliRunner().invoke(bench_app, ["console", "--rows", "1", "--database-url",
                                         "postgresql://postgres@127.0.0.1:1/test"])
    assert res.exit_code == 2 and "not reachable" in res.output, res.output
