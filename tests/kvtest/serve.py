"""A live `kvpool serve` for tests: started on free ports, stopped (SIGTERM, then
SIGKILL) when the block ends, also on failure. Every wait is bounded."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from kvtest.ports import free_port  # noqa: F401 (re-exported for the tests that import it from here)

KVPOOL = str(Path(sys.executable).with_name("kvpool"))


@dataclass
class Served:
    proc: subprocess.Popen
    port: int
    log_dir: Path
    ready_line: str
    # Everything kvpool serve itself printed so far (its children log to log_dir).
    output: list[str]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in sorted(self.log_dir.glob("*.log")))


@contextlib.contextmanager
def kvpool_serve(model_dir, log_dir, *extra: str, ready_timeout: float = 120.0, env: dict | None = None, new_session: bool = False):
    """``new_session``: kvpool serve leads a process group of its own (a test may signal the group)."""
    port = free_port()
    log_dir = Path(log_dir)
    argv = [KVPOOL, "serve", str(model_dir), "--port", str(port), "--log-dir", str(log_dir), "--kv-cache-memory", "8MiB",
            "--device", "cpu", *extra]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, **(env or {})},
                            start_new_session=new_session)
    lines: list[str] = []
    ready = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line)
            if " ready at " in line:
                ready.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + ready_timeout
        while not ready.wait(0.2):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvpool serve did not get ready (status {proc.poll()}):\n{''.join(lines)}")
        yield Served(proc, port, log_dir, next(line for line in lines if " ready at " in line), lines)
    finally:
        stop(proc)
        reader.join(5)


def stop(proc: subprocess.Popen, timeout: float = 30.0) -> int:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
    return proc.returncode
