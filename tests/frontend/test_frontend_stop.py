"""``python -m frontend`` stops on SIGTERM at any time, start-up included: while it still
waits for a scheduler (up to --connect-timeout), a stop ends it at once, cleanly."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from kvtest.ports import free_port

pytestmark = pytest.mark.e2e


def test_sigterm_while_waiting_for_the_scheduler_exits_at_once(tiny_checkpoint, tmp_path):
    nobody = free_port()  # no scheduler listens here
    argv = [sys.executable, "-m", "frontend", "--model", str(tiny_checkpoint), "--port", str(free_port()),
            "--scheduler", f"tcp://127.0.0.1:{nobody}", "--scheduler-http", f"http://127.0.0.1:{nobody}",
            "--connect-timeout", "120"]
    log = tmp_path / "frontend.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        # NOTE: long enough for the interpreter to import and install its handlers; far
        # below the 120 s it would wait for a scheduler.
        time.sleep(5)
        assert proc.poll() is None, log.read_text()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=15) == 0, log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
