"""`lockgate serve` listens on loopback unless an interface is configured: a server started on
defaults cannot be reached from another interface of the machine, and one told to listen on
all interfaces can (the control that shows the probe works). A live server: the bind address
is uvicorn's."""

from __future__ import annotations

import socket

import httpx
import pytest

from lockgate.gateway.settings import Settings
from tests.support.gateway_server import running_server


def outward_address() -> str | None:
    """This machine's address on its outward interface (no packet is sent), if it has one."""
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        s.connect(("10.255.255.255", 1))
        addr = s.getsockname()[0]
    except OSError:
        return None
    finally:
        s.close()
    return None if addr.startswith("127.") else addr


def test_the_default_host_is_loopback(monkeypatch):
    monkeypatch.delenv("LOCKGATE_HOST", raising=False)
    assert Settings().host == "127.0.0.1"


def test_a_server_on_defaults_is_not_reachable_from_outside(tmp_path):
    addr = outward_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with running_server(tmp_path, "embedded") as srv:
        port = int(srv.url.rsplit(":", 1)[1])
        assert httpx.get(srv.url + "/health", timeout=5).status_code == 200
        with pytest.raises(OSError):
            socket.create_connection((addr, port), timeout=2).close()


def test_a_configured_interface_is_reachable(tmp_path):
    """The control: the same probe connects when the server is told to listen on all
    interfaces, so the test above can fail."""
    addr = outward_address()
    if addr is None:
        pytest.skip("this machine has no non-loopback IPv4 address to try")
    with running_server(tmp_path, "embedded", extra_args=["--host", "0.0.0.0"]) as srv:  # noqa: S104
        port = int(srv.url.rsplit(":", 1)[1])
        socket.create_connection((addr, port), timeout=2).close()
