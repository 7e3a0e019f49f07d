"""What a new user meets: run from a venv where `pip install .` took the newest versions the
declared ranges allow, outside the checkout. Checks the install's names (one top-level
`lockgate`; Hugging Face's `kernels` untouched beside it), then starts `lockgate serve` on the
embedded default and has the official client ask it for a chat. Exits non-zero on any miss."""

from __future__ import annotations

import importlib.metadata as md
import importlib.util
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def check_names() -> None:
    import kernels

    assert hasattr(kernels, "get_kernel"), f"`kernels` is not Hugging Face's: {kernels.__file__}"
    for bare in ("engine", "gateway", "tenancy", "migrations", "loadtests"):
        assert importlib.util.find_spec(bare) is None, f"`import {bare}` resolves outside lockgate"
    import lockgate.engine
    import lockgate.gateway.cli

    print(f"newest: lockgate {md.version('lockgate')} at {Path(lockgate.engine.__file__).parent}; "
          f"transformers {md.version('transformers')}, kernels {md.version('kernels')} "
          f"at {Path(kernels.__file__).parent}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_and_chat(lockgate: str) -> None:
    from openai import OpenAI

    data = Path(tempfile.mkdtemp(prefix="lockgate-newest-"))
    port = free_port()
    log = (data / "serve.log").open("w")
    env = {**os.environ, "LOCKGATE_DATA_DIR": str(data)}
    proc = subprocess.Popen([lockgate, "serve", "--port", str(port)], stdout=log, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, env=env, cwd=data)
    try:
        deadline = time.monotonic() + 180
        while not (data / "demo_key").exists() or not _answers(port):
            if proc.poll() is not None or time.monotonic() > deadline:
                print((data / "serve.log").read_text()[-4000:], file=sys.stderr)
                raise SystemExit(f"newest: lockgate serve did not come up (exit {proc.poll()})")
            time.sleep(0.5)
        client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=(data / "demo_key").read_text().strip(),
                        timeout=60, max_retries=0)
        r = client.chat.completions.create(model="demo", max_tokens=8,
                                           messages=[{"role": "user", "content": "Hello"}])
        assert r.choices[0].message.content, r
        assert r.usage is not None and r.usage.completion_tokens > 0, r.usage
        print(f"newest: lockgate serve answered a chat: {r.usage.completion_tokens} tokens, "
              f"finish_reason {r.choices[0].finish_reason}")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()


def _answers(port: int) -> bool:
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


if __name__ == "__main__":
    check_names()
    serve_and_chat(str(Path(sys.executable).parent / "lockgate"))
