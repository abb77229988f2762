"""Security over real sockets: CURVE admits only known keys; no unauthenticated
non-loopback bind; the development endpoint exists only in dev mode."""

from __future__ import annotations

import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import zmq
import zmq.auth
from kvtest.cluster import ROOT, Cluster
from kvtest.replies import Replies

from protocol.client_messages import Generate, TokenOutput
from protocol.curve import apply_client

pytestmark = pytest.mark.e2e


@pytest.fixture
def keys(tmp_path):
    server, allowed, other = tmp_path / "server", tmp_path / "allowed", tmp_path / "other"
    for d in (server, allowed, other):
        d.mkdir()
    zmq.auth.create_certificates(server, "scheduler")
    zmq.auth.create_certificates(allowed, "worker")
    zmq.auth.create_certificates(allowed, "client")
    zmq.auth.create_certificates(other, "intruder")
    return {
        "server_secret": server / "scheduler.key_secret", "server_public": server / "scheduler.key",
        "allowed": allowed, "worker": allowed / "worker.key_secret", "client": allowed / "client.key_secret",
        "intruder": other / "intruder.key_secret",
    }


def _ask(c: Cluster, sock: zmq.Socket, timeout_ms: int) -> object | None:
    sock.connect(f"tcp://127.0.0.1:{c.port}")
    sock.send(c.codec.encode(Generate("hello", [5, 6, 7, 8], 3, ignore_eos=True)))
    got = []
    replies = Replies(sock)
    while (msg := replies.poll(timeout_ms / 1000)) is not None:
        got.append(msg)
        if isinstance(msg, TokenOutput) and msg.finished:
            break
    return got or None


def test_curve_admits_known_keys_and_refuses_others(keys, tmp_path):
    sched = ["--curve-secret-key", str(keys["server_secret"]), "--curve-authorized-keys", str(keys["allowed"])]
    worker = ["--curve-client-key", str(keys["worker"]), "--curve-server-key", str(keys["server_public"])]
    with Cluster(sched, worker, log_dir=tmp_path) as c:  # the worker got in: /health is 200
        ctx = c.ctx
        good = ctx.socket(zmq.DEALER)
        apply_client(good, keys["client"], keys["server_public"])
        bad = ctx.socket(zmq.DEALER)
        apply_client(bad, keys["intruder"], keys["server_public"])
        plain = ctx.socket(zmq.DEALER)
        try:
            replies = _ask(c, good, 10_000)
            assert replies and isinstance(replies[-1], TokenOutput) and replies[-1].finished
            assert _ask(c, bad, 1500) is None
            assert _ask(c, plain, 1500) is None
        finally:
            for s in (good, bad, plain):
                s.close(linger=0)
        # A worker without the right key does not get in either.
        intruder = c.spawn_worker("intruder", ["--curve-client-key", str(keys["intruder"]), "--curve-server-key",
                                               str(keys["server_public"]), "--scheduler-timeout", "1"])
        try:
            # CURVE drops its handshake silently, so it never hears a WorkerReady: after
            # its --scheduler-timeout it gives up as "scheduler unreachable" (exit 3).
            assert intruder.wait(60) == 3
            assert "no WorkerReady" in (tmp_path / "intruder.log").read_text()
            assert c.health() == 200
            # The admitted worker still serves: the intruder took nothing over.
            again = ctx.socket(zmq.DEALER)
            apply_client(again, keys["client"], keys["server_public"])
            try:
                replies = _ask(c, again, 10_000)
            finally:
                again.close(linger=0)
            assert replies and isinstance(replies[-1], TokenOutput) and replies[-1].finished
        finally:
            intruder.kill()
            intruder.wait(10)


def test_non_loopback_without_curve_is_refused():
    out = subprocess.run([sys.executable, "-m", "scheduler", "--host", "0.0.0.0"], cwd=ROOT, capture_output=True, text=True, timeout=30)
    assert out.returncode != 0
    assert "CURVE" in out.stderr and "loopback" in out.stderr


def test_reset_prefix_cache_only_in_dev_mode(tmp_path):
    with Cluster([], log_dir=tmp_path) as c:
        req = urllib.request.Request(f"http://127.0.0.1:{c.http_port}/reset_prefix_cache", method="POST")
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=5)
        assert e.value.code == 404
