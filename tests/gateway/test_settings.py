"""Settings from the environment and a config file; model specs."""

from __future__ import annotations

import json

import pytest

from lockgate.gateway.settings import Settings, parse_model_specs


def test_env_and_config_file(tmp_path, monkeypatch):
    cfg = tmp_path / "lockgate.json"
    cfg.write_text(json.dumps({"port": 9001, "max_n": 4, "redis_url": "redis://file"}))
    monkeypatch.setenv("LOCKGATE_CONFIG", str(cfg))
    monkeypatch.setenv("LOCKGATE_REDIS_URL", "redis://env")      # env wins over the file
    monkeypatch.setenv("LOCKGATE_ENGINE_KWARGS", '{"max_num_seqs": 8}')
    s = Settings()
    assert (s.port, s.max_n, s.redis_url) == (9001, 4, "redis://env")
    assert s.engine_kwargs == {"max_num_seqs": 8}
    assert s.embedded and s.resolved_database_url().startswith("sqlite+aiosqlite:///")
    toml = tmp_path / "lockgate.toml"
    toml.write_text('port = 9002\nmodels = ["a=/x"]\n')
    monkeypatch.setenv("LOCKGATE_CONFIG", str(toml))
    s = Settings()
    assert s.port == 9002 and s.models == ["a=/x"]


def test_bad_settings_name_the_field(monkeypatch):
    monkeypatch.setenv("LOCKGATE_PORT", "70000")
    with pytest.raises(ValueError, match="port"):
        Settings()
    monkeypatch.delenv("LOCKGATE_PORT")
    with pytest.raises(ValueError, match="no_such"):
        Settings(no_such=1)


def test_model_specs(tmp_path):
    (tmp_path / "m1").mkdir()
    (tmp_path / "m2").mkdir()
    specs = parse_model_specs([f"first={tmp_path / 'm1'}", str(tmp_path / "m2")])
    assert specs == {"first": tmp_path / "m1", "m2": tmp_path / "m2"}
    with pytest.raises(ValueError, match="given twice"):
        parse_model_specs([f"a={tmp_path / 'm1'}", f"a={tmp_path / 'm2'}"])
    with pytest.raises(ValueError, match="not a directory"):
        parse_model_specs([f"a={tmp_path / 'nope'}"])
    with pytest.raises(ValueError, match="empty name"):
        parse_model_specs([f"={tmp_path / 'm1'}"])
