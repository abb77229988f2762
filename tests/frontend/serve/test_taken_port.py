"""``kvpool serve`` chooses free loopback ports for its children's own sockets, then the
children bind them: in between, another process may take one (most often as an outgoing
connection's ephemeral port), and the child that binds it exits at start-up. The launcher
then starts its children again on other ports instead of failing; a port nobody took, or a
child that failed for another reason, still ends the start as before."""

from __future__ import annotations

import signal
import socket
import threading
import time

import pytest
from kvtest.ports import free_port

from frontend.serve import launcher
from frontend.serve.child_ports import free_ports, taken_ports
from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


@pytest.fixture
def held_port():
    """A loopback port another process (this one) listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_taken_ports_names_the_ports_someone_listens_on(held_port):
    (free,) = free_ports(1)
    assert taken_ports([free, held_port]) == [held_port]


def run_until_ready(la: Launcher, timeout: float = 120.0) -> tuple[int, bool]:
    """Run the launcher here (it installs signal handlers: the main thread), stopped once its
    frontend answers or ``timeout`` passes; its exit status, and whether it was ready."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    ready = threading.Event()

    def stop_when_ready():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not la.stopping:
            if getattr(la, "probe", None) is not None and la.children and la.probe.healthy():
                ready.set()
                break
            time.sleep(0.2)
        la.stopping = True

    watcher = threading.Thread(target=stop_when_ready, daemon=True)
    watcher.start()
    try:
        rc = la.run()
    finally:
        la.stopping = True
        watcher.join(5)
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    return rc, ready.is_set()


def test_a_chosen_port_taken_before_the_scheduler_binds_it_starts_the_children_on_others(
        tiny_checkpoint, tmp_path, held_port, monkeypatch, capsys):
    calls = []

    def choose(n):
        # The first choice hands the scheduler's client socket a port already taken.
        ports = free_ports(n)
        calls.append(ports if calls else [held_port, *ports[1:]])
        return calls[-1]

    monkeypatch.setattr(launcher, "free_ports", choose)
    config = parse_serve(["serve", str(tiny_checkpoint), "--port", str(free_port()), "--kv-cache-memory", "8MiB",
                          "--device", "cpu", "--log-dir", str(tmp_path)])
    logs: list[str] = []
    la = Launcher(config, log=lambda *a, **k: logs.append(" ".join(map(str, a))))
    rc, ready = run_until_ready(la)
    assert ready and rc == 0, logs
    assert len(calls) == 2 and held_port not in calls[1]
    assert any(f"port {held_port}, chosen for its processes, was taken by another" in line for line in logs), logs
    assert "ready at" in capsys.readouterr().out


def test_a_child_that_fails_for_another_reason_is_not_started_again(tiny_checkpoint, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(launcher, "free_ports", lambda n: calls.append(n) or free_ports(n))
    # A worker that cannot hold its KV cache exits at start-up: no port is taken, one start only.
    config = parse_serve(["serve", str(tiny_checkpoint), "--port", str(free_port()), "--kv-cache-memory", "1",
                          "--device", "cpu", "--log-dir", str(tmp_path)])
    logs: list[str] = []
    la = Launcher(config, log=lambda *a, **k: logs.append(" ".join(map(str, a))))
    rc, ready = run_until_ready(la)
    assert (rc, ready) == (1, False)
    assert len(calls) == 1 and not any("was taken by another" in line for line in logs)
    assert any("exited during start-up" in line for line in logs), logs
