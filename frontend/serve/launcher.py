"""``kvpool serve MODEL``: the scheduler, the worker and the frontend as three
processes, supervised (vLLM's ``vllm serve``, with the engine core split out).

* Internal sockets bind loopback ports chosen free at start, so two ``kvpool serve``
  on one host never collide; only ``--host``/``--port`` is the operator's. One taken by
  another process before its child bound it: the children start again on others
  (``frontend/serve/child_ports.py``).
* One line when ready: the model, the URL, the KV pool (blocks × block size, and the
  bytes the scheduler exports from its worker's report).
* SIGINT/SIGTERM stop every child (SIGTERM, then SIGKILL after ``--stop-timeout``);
  children get SIGTERM should the launcher itself die (``PR_SET_PDEATHSIG``).
* A child that exits is restarted alone, on the same ports (``frontend/serve/restart_policy.py``;
  ``--worker-restarts``, ``--scheduler-restarts``, ``--frontend-restarts``), so no process
  is a single point of failure:
  - the worker: new requests wait in the scheduler's queue, which puts the lost worker's
    requests back in it, so a crashed worker costs none. With ``--tensor-parallel-size N``
    the worker is rank 0 of a group that starts the other ranks itself; any rank dying
    ends the group (rank 0 exits), so restarting the worker restarts the whole group.
  - the scheduler: the worker sees its connection drop and handshakes with the next one
    (``--reconnect``); the frontend holds every request it accepted and gives them to the
    next one with the tokens already streamed, to resume as preempted requests do
    (``frontend/engine/client.py``), new requests waiting meanwhile; no client sees it.
  - the frontend: its clients' open connections are cut (the scheduler frees their
    requests' blocks); new connections wait in the listening socket's backlog, which the
    launcher holds and hands to each frontend (``--listen-fd``), until the next one accepts.

The launcher runs on one frozen ``ServeConfig`` (``frontend/serve/config.py``), made by
``frontend/serve/cli.py`` from the table of ``vllm serve``'s flags (``frontend/serve/flags``)
and the settings table (``protocol/serve_flags``); each child's argv is written from the
same rows (``frontend/serve/child_argv.py``).
"""

from __future__ import annotations

import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from frontend.http.listen import bind_listener, remove_unix_socket
from frontend.serve import child_argv
from frontend.serve.child_ports import free_ports, taken_ports
from frontend.serve.config import ServeConfig
from frontend.serve.model_dir import checkpoint_problem
from frontend.serve.ready_line import ready_line
from frontend.serve.ready_probe import FrontendProbe, requires_client_certificates
from frontend.serve.restart_policy import RestartPolicy

PR_SET_PDEATHSIG = 1
# NOTE: what the kernel queues while no frontend accepts (a restart: 40 requests/s for a
# few seconds); Linux caps it at net.core.somaxconn (4096).
LISTEN_BACKLOG = 1024
# Starts on fresh ports when one chosen for a child was taken before the child bound it.
START_ATTEMPTS = 3
CHILDREN = ("scheduler", "worker", "frontend")
POLL_S = 0.2


def _die_with_parent() -> None:  # runs in the child between fork and exec
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _last_line(log_path: Path | None) -> str:
    """": LINE", the last line of a child's log (its error), or "" without one."""
    try:
        lines = log_path.read_text(errors="replace").strip().splitlines() if log_path is not None else []
    except OSError:
        return ""
    return f": {lines[-1].strip()}" if lines else ""


@dataclass
class Child:
    name: str
    argv: list[str]
    log_path: Path | None
    proc: subprocess.Popen | None = None
    started_at: float = 0.0  # time.monotonic() of the last start
    # File descriptors it inherits (the frontend's listening socket).
    pass_fds: tuple[int, ...] = ()
    _log: object = field(default=None, repr=False)

    def start(self) -> None:
        out = None
        if self.log_path is not None:
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - kept open for the child's life
            out = self._log
        self.proc = subprocess.Popen(self.argv, stdout=out, stderr=subprocess.STDOUT if out else None, preexec_fn=_die_with_parent,
                                     pass_fds=self.pass_fds)
        self.started_at = time.monotonic()

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class Launcher:
    def __init__(self, config: ServeConfig, log=print):
        self.config = config
        self.log = log
        self.children: dict[str, Child] = {}
        self.stopping = False
        self.restarts = {name: RestartPolicy(getattr(config, f"{name}_restarts"), name=name) for name in CHILDREN}
        # The children waiting out their back-off: when each starts again.
        self.restart_at: dict[str, float] = {}
        self.listener: socket.socket | None = None
        self.uds_inode: int | None = None

    def build(self) -> None:
        c = self.config
        client_port, worker_port, sched_http, worker_http = self.chosen_ports = free_ports(4)
        if c.worker_http_port is not None:
            worker_http = c.worker_http_port
            self.chosen_ports = self.chosen_ports[:3]
        self.scheduler_http = f"http://127.0.0.1:{sched_http}"
        tls = bool(c.given.get("ssl_certfile"))
        self.url = f"{'https' if tls else 'http'}://{c.host}:{c.port}"
        # NOTE: with --uds the frontend listens on that socket, not on --host/--port (both ignored, as vLLM).
        self.uds = c.given.get("uds") or None
        cert_required = requires_client_certificates(c.given.get("ssl_cert_reqs"))
        self.probe = FrontendProbe(c.host, c.port, self.uds, tls, cert_required, self.scheduler_http)
        logs = Path(c.log_dir) if c.log_dir else None
        if logs is not None:
            logs.mkdir(parents=True, exist_ok=True)
        argvs = {
            "scheduler": child_argv.scheduler_argv(c, client_port, worker_port, sched_http),
            "worker": child_argv.worker_argv(c, worker_port, worker_http),
            "frontend": child_argv.frontend_argv(c, client_port, self.scheduler_http),
        }
        for name, argv in argvs.items():
            self.children[name] = Child(name, argv, logs / f"{name}.log" if logs else None)
        if self.listener is not None:
            self._hand_listener()

    def listen(self) -> None:
        """Bind the API's socket here and hand it to the frontend (``--listen-fd``), so that
        connections made while a frontend restarts wait in the backlog for the next one
        instead of being refused."""
        c = self.config
        self.listener = bind_listener(c.host, c.port, self.uds, LISTEN_BACKLOG)
        self.uds_inode = os.stat(self.uds).st_ino if self.uds is not None else None
        self._hand_listener()

    def _hand_listener(self) -> None:
        frontend = self.children["frontend"]
        frontend.argv = [*frontend.argv, "--listen-fd", str(self.listener.fileno())]
        frontend.pass_fds = (self.listener.fileno(),)

    def run(self) -> int:
        self.build()
        try:
            self.listen()
        except OSError as e:
            self.log(f"kvpool serve: {e}")
            return 1
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        try:
            rc = self._start()
            if rc is None:
                rc = self._supervise()
        finally:
            self.stop_all()
        return rc

    def _start(self) -> int | None:
        """Start the children and wait until they are ready (None), or why not (1, 0 when
        stopped). NOTE: a port chosen free for a child may be taken (an outgoing connection's
        ephemeral port) before the child binds it: then all start again on other ports."""
        for attempt in range(1, START_ATTEMPTS + 1):
            for c in self.children.values():
                c.start()
            rc = self._wait_ready()
            if rc != 1 or attempt == START_ATTEMPTS:
                return rc
            self.stop_children()
            taken = taken_ports(self.chosen_ports)
            if not taken:
                return rc
            self.log(f"kvpool serve: port {taken[0]}, chosen for its processes, was taken by another; starting them on others")
            self.build()
        return 1

    def _on_signal(self, signum, _frame) -> None:
        self.stopping = True

    def _dead(self) -> str | None:
        return next((n for n in CHILDREN if not self.children[n].alive()), None)

    def _wait_ready(self) -> int | None:
        deadline = time.monotonic() + self.config.ready_timeout
        while not self.stopping:
            dead = self._dead()
            if dead is not None:
                child = self.children[dead]
                # NOTE: a flag passed on as given is checked by the child: its last line says what was wrong.
                self.log(f"kvpool serve: the {dead} exited during start-up (status {child.proc.returncode}){_last_line(child.log_path)}")
                return 1
            if self.probe.healthy():
                self._print_ready()
                return None
            if time.monotonic() > deadline:
                self.log(f"kvpool serve: not ready within {self.config.ready_timeout:g} s")
                return 1
            time.sleep(POLL_S)
        return 0

    def _print_ready(self) -> None:
        where = f"unix:{self.uds} /v1" if self.uds is not None else f"{self.url}/v1"
        print(ready_line(self.config, self.scheduler_http, where), flush=True)

    def _supervise(self) -> int:
        """Restart whichever child exits, after its back-off, until one gives up (1) or a
        signal stops the server (0). Each is restarted alone: a worker re-registers with
        the scheduler, a scheduler is re-registered with by the worker and given the
        frontend's requests in flight again, a frontend reconnects (its clients' open
        connections are cut; the scheduler frees their requests)."""
        while not self.stopping:
            now = time.monotonic()
            for name, child in self.children.items():
                if name in self.restart_at:
                    if now >= self.restart_at[name]:
                        del self.restart_at[name]
                        child.start()
                    continue
                if child.alive():
                    continue
                policy = self.restarts[name]
                delay = policy.after_exit(now - child.started_at)
                if delay is None:
                    self.log(f"kvpool serve: {policy.why_give_up()}")
                    return 1
                self.log(f"kvpool serve: the {name} exited (status {child.proc.returncode}); restarting it in {delay:g} s")
                self.restart_at[name] = now + delay
            time.sleep(POLL_S)
        return 0

    def stop_all(self) -> None:
        self.stop_children()
        if self.listener is not None:
            self.listener.close()
            remove_unix_socket(self.uds, self.uds_inode)

    def stop_children(self) -> None:
        # NOTE: the frontend first (no new requests), the scheduler last (it tells
        # its clients their requests ended).
        order = [self.children[n] for n in ("frontend", "worker", "scheduler") if n in self.children]
        signalled = [c for c in order if c.alive()]
        for c in signalled:
            c.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + self.config.stop_timeout
        for c in order:
            if c.proc is None:
                continue
            try:
                c.proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                self.log(f"kvpool serve: the {c.name} ignored SIGTERM for {self.config.stop_timeout:g} s; killing it")
                c.proc.kill()
                c.proc.wait()
            else:
                if c in signalled and c.proc.returncode != 0:
                    self.log(f"kvpool serve: the {c.name} exited with status {c.proc.returncode} on SIGTERM")
            if c._log is not None:
                c._log.close()


def main_serve(config: ServeConfig) -> int:
    if (problem := checkpoint_problem(config.model, config.model_dir)) is not None:
        print(f"kvpool serve: {problem}", file=sys.stderr)
        return 2
    return Launcher(config, log=lambda *a, **k: print(*a, file=sys.stderr, **k)).run()
