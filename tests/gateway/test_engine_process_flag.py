"""`lockgate serve --engine-process` builds the embedded engine as a `ProcessEngine`; without
it, or with `--no-engine-process`, as an `AsyncEngine` in the server's process."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from lockgate.engine import AsyncEngine, ProcessEngine
from lockgate.gateway import server
from lockgate.gateway.cli import app
from lockgate.gateway.settings import Settings


@pytest.mark.parametrize(("args", "engine"), [(["--engine-process"], ProcessEngine), ([], AsyncEngine),
                                              (["--no-engine-process"], AsyncEngine)])
def test_the_flag_picks_the_embedded_engine(monkeypatch, tmp_path, args, engine):
    seen: list[Settings] = []
    factories: list[object] = []

    def run_server(settings: Settings) -> int:
        seen.append(settings)
        return 0

    def create_app(settings: Settings, engine_factory: object) -> None:
        factories.append(engine_factory)
        raise SystemExit(0)

    monkeypatch.setattr(server, "run_server", run_server)
    monkeypatch.setattr(server, "create_app", create_app)
    monkeypatch.delenv("LOCKGATE_ENGINE_PROCESS", raising=False)
    result = CliRunner().invoke(app, ["serve", "--data-dir", str(tmp_path), *args])
    assert result.exit_code == 0, result.output
    with pytest.raises(SystemExit):
        server._serve(seen[0], sock=None)  # type: ignore[arg-type]
    assert factories == [engine]
