"""The native client against a CURVE scheduler port: a refused handshake is
reported at once, naming what to give (not a timeout asking if it runs)."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from loadgen.client import KVPoolClient
from loadgen.request_result import SchedulerUnreachable
from protocol.curve import apply_server


@pytest.fixture
def curve_port(tmp_path):
    """A CURVE ROUTER on loopback admitting only keys in allowed/; yields
    (address, server public cert, an allowed client's secret, a stranger's secret)."""
    allowed, other = tmp_path / "allowed", tmp_path / "other"
    allowed.mkdir()
    other.mkdir()
    server_public, server_secret = zmq.auth.create_certificates(tmp_path, "scheduler")
    _, client_secret = zmq.auth.create_certificates(allowed, "client")
    _, stranger_secret = zmq.auth.create_certificates(other, "stranger")
    ctx = zmq.Context()
    auth = ThreadAuthenticator(ctx)
    auth.start()
    auth.configure_curve(domain="*", location=str(allowed))
    sock = ctx.socket(zmq.ROUTER)
    try:
        apply_server(sock, server_secret)
        port = sock.bind_to_random_port("tcp://127.0.0.1")
        yield f"tcp://127.0.0.1:{port}", server_public, client_secret, stranger_secret
    finally:
        sock.close(linger=0)
        auth.stop()
        ctx.term()


def connect(address: str, keys=None, timeout: float = 5.0) -> None:
    async def go():
        async with KVPoolClient(address, curve_keys=keys) as client:
            await client.connect(timeout)

    asyncio.run(asyncio.wait_for(go(), 20))


def test_without_keys_the_error_says_the_scheduler_requires_curve(curve_port):
    address, *_ = curve_port
    with pytest.raises(SchedulerUnreachable, match="requires CURVE") as e:
        connect(address, timeout=10.0)
    assert "--curve-client-key" in str(e.value) and "--curve-server-key" in str(e.value)


def test_an_unauthorized_key_is_named_as_refused(curve_port):
    address, server_public, _, stranger_secret = curve_port
    with pytest.raises(SchedulerUnreachable, match="refused this client's CURVE key"):
        connect(address, (str(stranger_secret), str(server_public)), timeout=10.0)


def test_an_authorized_key_connects(curve_port):
    address, server_public, client_secret, _ = curve_port
    connect(address, (str(client_secret), str(server_public)))
