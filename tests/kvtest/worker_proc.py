"""A real `python -m worker` process for the worker's process tests: tiny checkpoint on the
CPU, block size 4, 1 MiB of KV, killed (also on failure) and reaped when the test ends."""

from __future__ import annotations

import contextlib
import subprocess
import sys


@contextlib.contextmanager
def worker_process(endpoint: str, *extra: str, dtype: str = "float64"):
    cmd = [sys.executable, "-m", "worker", "--scheduler", endpoint, "--device", "cpu", "--dtype", dtype,
           "--block-size", "4", "--kv-cache-memory", "1MiB", *extra]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.communicate(timeout=10)
