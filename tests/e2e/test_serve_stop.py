"""`kvpool serve` stops cleanly and at once on SIGTERM: to its whole process group (what
systemd and a terminal's Ctrl-C send), every child exits 0 without a traceback, each
signalled twice (the group's SIGTERM, then the launcher's); the frontend alone ends its
open responses with finish reason "abort" rather than wait for their requests. Every
wait is bounded; every process started here is stopped here, also on failure."""

from __future__ import annotations

import json
import os
import signal
import threading
import urllib.request
from pathlib import Path

import pytest
from kvtest.http_api import PROMPT
from kvtest.procs import children
from kvtest.serve import kvpool_serve
from kvtest.waiting import wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# NOTE: a child that ignored SIGTERM would hold the launcher this long before its
# SIGKILL; the waits below are well under it, so such a child fails them.
STOP_TIMEOUT_S = 60
STOP_WAIT_S = 30


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def _sigterm(pid: int) -> bool:
    """SIGTERM to ``pid``; False (not gone yet)."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    return False


def role(pid: int, name: str) -> int:
    (child,) = [p for p, cmd in children(pid).items() if f"-m {name} " in cmd]
    return child


def test_sigterm_to_the_process_group_stops_every_child_with_status_0_and_no_traceback(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path, "--stop-timeout", str(STOP_TIMEOUT_S), new_session=True) as s:
        kids = list(children(s.proc.pid))
        assert len(kids) == 3
        os.killpg(s.proc.pid, signal.SIGTERM)
        # NOTE: and again, to each child until it is gone: a repeated SIGTERM landing
        # anywhere in a stop under way (the launcher sends its own) must not change its end.
        wait_for(lambda: all(gone(p) or _sigterm(p) for p in kids), "every child to exit", STOP_WAIT_S)
        assert s.proc.wait(STOP_WAIT_S) == 0, "".join(s.output)
        said = "".join(s.output)
        # the launcher names any child that ignored SIGTERM, or exited non-zero on it
        assert "ignored SIGTERM" not in said and "on SIGTERM" not in said, said
    logs = {p.name: p.read_text(errors="replace") for p in tmp_path.glob("*.log")}
    assert set(logs) == {"scheduler.log", "worker.log", "frontend.log"}
    for name, text in logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    assert "SIGTERM: telling the scheduler and exiting" in logs["worker.log"]


def test_a_stopping_frontend_ends_a_held_stream_with_abort_at_once(tiny_checkpoint, tmp_path):
    # NOTE: the scheduler would hold the request this long for a worker: far past the waits below
    with kvpool_serve(tiny_checkpoint, tmp_path, "--worker-restart-timeout", "300") as s:
        frontend, worker = role(s.proc.pid, "frontend"), role(s.proc.pid, "worker")
        body = json.dumps({"prompt": PROMPT, "max_tokens": 2000, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(s.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        events: list[dict] = []
        done = threading.Event()
        with urllib.request.urlopen(req, timeout=STOP_WAIT_S) as r:
            events.append(json.loads(r.readline()[6:]))  # the stream is under way
            # NOTE: a stopped worker computes nothing: the request stays in flight for as
            # long as the frontend waits on it (the scheduler would hold it for a worker).
            os.kill(worker, signal.SIGSTOP)
            try:

                def read_rest():
                    try:
                        for line in r:
                            if line.startswith(b"data: {"):
                                events.append(json.loads(line[6:]))
                    finally:
                        done.set()

                reader = threading.Thread(target=read_rest, daemon=True)
                reader.start()
                os.kill(frontend, signal.SIGTERM)
                wait_for(lambda: gone(frontend), "the frontend to exit", STOP_WAIT_S)
                assert done.wait(10), "the stream was left open"
            finally:
                os.kill(worker, signal.SIGCONT)
        assert all("error" not in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "abort", events[-1]
        assert "Traceback" not in (tmp_path / "frontend.log").read_text(errors="replace")
