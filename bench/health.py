"""Waiting for a bench's own processes to answer ``/health`` (bounded; a child that
exits ends the wait at once)."""

from __future__ import annotations

import subprocess
import time
import urllib.request


def wait_healthy(url: str, procs: list[subprocess.Popen], what: str, timeout: float = 120.0) -> None:
    """Return once ``url`` + /health answers 200; RuntimeError naming ``what`` when a
    process of ``procs`` exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if urllib.request.urlopen(url + "/health", timeout=2).status == 200:
                return
        except OSError:
            pass
        if any(p.poll() is not None for p in procs):
            break
        time.sleep(0.3)
    raise RuntimeError(f"{what} did not get ready")
