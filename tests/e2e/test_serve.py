"""`lockgate serve` as an operator meets it: first start (keys shown once), schema checks,
draining on SIGTERM, and configuration errors in one line instead of a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.gateway_server import ENGINE_KWARGS, GatewayServer, free_port
from tests.support.helpers import demo_model
from tests.support.services import fresh_pg_database

REPO = Path(__file__).resolve().parents[2]
CLI = [sys.executable, "-m", "lockgate.gateway.cli"]


def base_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """GatewayServer.start's environment, without LOCKGATE_ADMIN_KEY."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("LOCKGATE_")}
    env.update({
        "LOCKGATE_DATA_DIR": str(data_dir),
        "LOCKGATE_ENGINE_KWARGS": json.dumps(ENGINE_KWARGS),
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
    })
    env.update(extra)
    return env


def start_without_admin_key(data_dir: Path) -> GatewayServer:
    """`lockgate serve --model tiny=...` with stdout (and stderr) to a file, not a tty."""
    data_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = base_env(data_dir)
    log_path = data_dir / f"server-{port}.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*CLI, "serve", "--port", str(port), "--model", f"tiny={demo_model('llama', 'tiny', 0)}"],
            env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
    srv = GatewayServer(url=f"http://127.0.0.1:{port}", proc=proc, log_path=log_path, admin_key="",
                        data_dir=data_dir, env=env)
    srv.wait_ready(120)
    return srv


def run_cli(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, stdin=subprocess.DEVNULL)


def chat(url: str, key: str, **extra) -> httpx.Response:
    return httpx.post(url + "/v1/chat/completions", headers={"Authorization": f"Bearer {key}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                            "max_tokens": 3, **extra}, timeout=60)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_first_start_writes_keys_once(tmp_path):
    """Embedded, no LOCKGATE_ADMIN_KEY, stdout not a terminal: the admin key and the demo
    tenant's key go, bare, to 0600 files (so `$(cat FILE)` is the key), not to the log; the
    log has a curl line reading the key file, which works. A second start on the same data
    directory writes nothing new, the keys still work, and it says how to get back in with a
    lost admin key: `lockgate keys create --admin` makes one that works."""
    data_dir = tmp_path / "data"
    srv = start_without_admin_key(data_dir)
    admin_file, demo_file = data_dir / "admin_key", data_dir / "demo_key"
    try:
        assert mode(admin_file) == 0o600 and mode(demo_file) == 0o600
        admin_key, demo_key = admin_file.read_text(), demo_file.read_text()
        assert re.fullmatch(r"lg-\S+\n", admin_key) and re.fullmatch(r"lg-\S+\n", demo_key)
        admin_key, demo_key = admin_key.strip(), demo_key.strip()
        log = srv.log()
        assert admin_key not in log and demo_key not in log          # secrets only in the files
        assert f"admin key written to {admin_file}" in log
        assert f"demo key written to {demo_file}" in log

        # as a user would use the files: $(cat admin_key) in a shell
        done = subprocess.run(["bash", "-c", f'curl -sS -H "Authorization: Bearer $(cat {admin_file})" '
                               f"{srv.url}/admin/v1/tenants"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        assert [t["name"] for t in json.loads(done.stdout)["data"]] == ["demo"]
        r = chat(srv.url, demo_key)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["role"] == "assistant"

        # the logged curl line, as a user would paste it into a shell
        curl = next(ln.strip() for ln in log.splitlines() if ln.strip().startswith("curl "))
        assert srv.url.removeprefix("http://") in curl and f"$(cat {demo_file})" in curl
        done = subprocess.run(["bash", "-c", curl + " -sS"], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        body = json.loads(done.stdout)
        assert body["object"] == "chat.completion" and body["model"] == "tiny"
        assert isinstance(body["choices"][0]["message"]["content"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 16
    finally:
        assert srv.stop() == 0

    before = {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in (admin_file, demo_file)}
    again = start_without_admin_key(data_dir)
    try:
        log = again.log()
        assert "shown once" not in log and "written to" not in log
        assert "LOCKGATE_ADMIN_KEY" in log and "lockgate keys create --admin" in log
        assert {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in before} == before
        r = httpx.get(again.url + "/admin/v1/tenants", timeout=30,
                      headers={"Authorization": f"Bearer {admin_key}"})
        assert r.status_code == 200 and [t["name"] for t in r.json()["data"]] == ["demo"]
        assert chat(again.url, demo_key).status_code == 200

        # the way back in, while the server runs
        done = run_cli(["keys", "create", "--admin", "--name", "recovered"], base_env(data_dir))
        assert done.returncode == 0, done.stdout + done.stderr
        new_key = done.stdout.strip()
        assert re.fullmatch(r"lg-\S+", new_key) and new_key not in (admin_key, demo_key)
        r = httpx.get(again.url + "/admin/v1/tenants", timeout=30,
                      headers={"Authorization": f"Bearer {new_key}"})
        assert r.status_code == 200, r.text
        # a read-only key for the console, without curl: it reads the admin routes, changes nothing
        done = run_cli(["keys", "create", "--viewer", "--name", "ops-viewer"], base_env(data_dir))
        assert done.returncode == 0, done.stdout + done.stderr
        viewer_key = done.stdout.strip()
        viewer = {"Authorization": f"Bearer {viewer_key}"}
        r = httpx.get(again.url + "/admin/v1/keys", timeout=30, headers=viewer)
        assert r.status_code == 200, r.text
        assert [k["scopes"] for k in r.json()["data"] if k["name"] == "ops-viewer"] == [["viewer"]]
        r = httpx.post(again.url + "/admin/v1/tenants", timeout=30, headers=viewer, json={"name": "nope"})
        assert r.status_code == 403 and "viewer" in r.text, r.text
        done = run_cli(["keys", "create"], base_env(data_dir))
        assert done.returncode != 0 and "--admin" in done.stdout + done.stderr
        done = run_cli(["keys", "create", "--admin", "--viewer"], base_env(data_dir))
        assert done.returncode != 0 and "--viewer" in done.stdout + done.stderr
    finally:
        assert again.stop() == 0


def test_schema_behind_needs_upgrade_or_migrate(tmp_path):
    """An empty PostgreSQL database and no --migrate: serve refuses at once, naming the fix;
    after `lockgate db upgrade` it starts."""
    with fresh_pg_database() as url:
        env = base_env(tmp_path / "data", LOCKGATE_DATABASE_URL=url,
                       LOCKGATE_ADMIN_KEY="lg-" + "a" * 43)
        t0 = time.monotonic()
        done = run_cli(["serve", "--port", str(free_port()),
                        "--model", f"tiny={demo_model('llama', 'tiny', 0)}"], env)
        assert done.returncode != 0
        assert time.monotonic() - t0 < 30
        out = done.stdout + done.stderr
        assert "lockgate db upgrade" in out and "--migrate" in out, out
        assert "Traceback" not in out
        assert not (tmp_path / "data" / "lockgate.db").exists()       # no SQLite on the side

        done = run_cli(["db", "upgrade"], env)
        assert done.returncode == 0, done.stdout + done.stderr
        current, head = re.search(r"database at (\S+) \(head (\S+)\)", done.stdout).groups()
        assert current == head

        # not GatewayServer.start(database_url=...): that passes --migrate
        srv = GatewayServer.start(tmp_path / "data", admin_key=env["LOCKGATE_ADMIN_KEY"],
                                  extra_env={"LOCKGATE_DATABASE_URL": url})
        try:
            assert "--migrate" not in srv.proc.args
            _, key = srv.tenant()
            assert chat(srv.url, key).status_code == 200
        finally:
            assert srv.stop() == 0


def test_sigterm_drains_in_flight_stream(tmp_path):
    """SIGTERM during a long stream: the stream still ends with [DONE], new requests (on
    another kept-alive connection, or a new one) are answered 503 `server_draining` while it
    runs, the process exits 0, and the usage row is there."""
    max_tokens = 1500          # a few seconds of streaming: SIGTERM lands well inside it
    srv = GatewayServer.start(tmp_path / "data", extra_args=["--shutdown-timeout", "30"])
    try:
        _, key = srv.tenant()
        h = {"Authorization": f"Bearer {key}"}
        idle = httpx.Client(base_url=srv.url, headers=h, timeout=30)
        assert idle.get("/v1/models").status_code == 200      # its connection stays open
        body = {"model": "tiny", "messages": [{"role": "user", "content": "drain"}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        with httpx.Client(base_url=srv.url, headers=h, timeout=60) as c, \
                c.stream("POST", "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            first = next(ln for ln in lines if ln)
            request_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
            t_term = time.monotonic()
            srv.proc.send_signal(signal.SIGTERM)
            time.sleep(0.3)
            # while the stream holds the drain open, a new request is answered 503, on the
            # kept-alive connection and on a new one alike: never a refused connection
            late = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
            for answer in (idle.post("/v1/chat/completions", json=late),
                           httpx.post(srv.url + "/v1/chat/completions", json=late, headers=h, timeout=30),
                           httpx.get(srv.url + "/v1/models", headers=h, timeout=30)):
                assert answer.status_code == 503, answer.text
                assert answer.json()["error"]["code"] == "server_draining"
                assert answer.headers["retry-after"] == "5"
            ready = httpx.get(srv.url + "/ready", timeout=30)
            assert ready.status_code == 503 and ready.json()["draining"] is True
            rest = [ln for ln in lines if ln]
        idle.close()
        assert rest[-1] == "data: [DONE]"
        usage = json.loads(rest[-2][6:])["usage"]
        assert usage["completion_tokens"] == max_tokens
        srv.proc.wait(45)
        assert srv.proc.returncode == 0, srv.log()
        assert time.monotonic() - t_term < 40
        assert "Traceback" not in srv.log()
    finally:
        srv.stop()
    with sqlite3.connect(tmp_path / "data" / "lockgate.db") as db:
        rows = db.execute("SELECT status, completion_tokens FROM usage_records WHERE request_id = ?",
                          (request_id,)).fetchall()
    assert rows == [("ok", max_tokens)]


@pytest.mark.parametrize("args, env, names", [
    (["--model", "nosuchdir"], {}, "nosuchdir"),
    (["--model", "tiny=/nonexistent/model"], {}, "/nonexistent/model"),
    (["--private-model", "ghost"], {}, "ghost"),
    ([], {"LOCKGATE_PORT": "notanumber"}, "port"),
], ids=["model-dir", "named-model-dir", "private-model", "port"])
def test_bad_config_is_one_clear_error(tmp_path, args, env, names):
    done = run_cli(["serve", "--port", str(free_port()), *args] if "LOCKGATE_PORT" not in env
                   else ["serve", *args], base_env(tmp_path / "data", **env))
    out = done.stdout + done.stderr
    assert done.returncode != 0, out
    assert names in out, out
    assert "Traceback" not in out, out
    assert "Application startup failed" not in out, out


def test_quick_start_serves_the_demo_model(tmp_path):
    """The README's main job: `lockgate serve` with no model builds the demo model in the
    data directory on first start and serves it as `demo`, through the openai client."""
    import openai

    srv = GatewayServer.start(tmp_path / "data", models={})
    try:
        assert (tmp_path / "data" / "models" / "demo" / "config.json").is_file()
        _, key = srv.tenant()
        client = openai.OpenAI(base_url=srv.url + "/v1", api_key=key, max_retries=0, timeout=60)
        assert [m.id for m in client.models.list().data] == ["demo"]
        r = client.chat.completions.create(model="demo", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
        assert r.usage.completion_tokens == 8 and r.choices[0].message.content
    finally:
        assert srv.stop() == 0


def test_a_busy_port_is_refused_before_anything_is_minted(tmp_path):
    """A second `lockgate serve` on a port already listened on: one clear line naming the
    address, before any key is minted, shown or written (its data directory stays empty of
    keys and of a database)."""
    import socket

    port = free_port()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", port))
        busy.listen()
        data_dir = tmp_path / "data"
        done = run_cli(["serve", "--port", str(port), "--model", f"tiny={demo_model('llama', 'tiny', 0)}"],
                       base_env(data_dir))
    out = done.stdout + done.stderr
    assert done.returncode == 1, out
    assert f"127.0.0.1:{port}" in out and "already in use" in out, out
    assert "Traceback" not in out and "key" not in out, out
    assert not (data_dir / "admin_key").exists() and not (data_dir / "demo_key").exists()
    assert not (data_dir / "lockgate.db").exists()
