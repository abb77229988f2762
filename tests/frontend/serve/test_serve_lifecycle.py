"""`kvpool serve` as a supervisor: 503 until a worker is ready, a crashed worker
restarted without losing a request, SIGTERM leaves nothing behind, a dead scheduler
stops the rest with a non-zero status. Every process started here is stopped here."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvtest.http_api import PROMPT, post
from kvtest.procs import children
from kvtest.serve import free_port, kvpool_serve, stop

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def role(pid: int, name: str) -> int:
    (child,) = [p for p, cmd in children(pid).items() if f"-m {name} " in cmd]
    return child


def gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    # a zombie of ours not yet reaped counts as gone
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"


def wait_until(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_without_a_worker_health_and_generation_answer_503(tiny_checkpoint, tmp_path):
    client_port, worker_port, http_port, api_port = free_port(), free_port(), free_port(), free_port()
    procs = []
    try:
        procs.append(subprocess.Popen([sys.executable, "-m", "scheduler", "--port", str(client_port), "--worker-port", str(worker_port),
                                       "--http-port", str(http_port)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        procs.append(subprocess.Popen([sys.executable, "-m", "frontend", "--model", str(tiny_checkpoint), "--port", str(api_port),
                                       "--scheduler", f"tcp://127.0.0.1:{client_port}", "--scheduler-http",
                                       f"http://127.0.0.1:{http_port}"], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{api_port}"

        def health_status():
            try:
                return urllib.request.urlopen(base + "/health", timeout=2).status
            except urllib.error.HTTPError as e:
                return e.code
            except OSError:
                return None

        wait_until(lambda: health_status() is not None, 60, "the frontend to listen")
        assert health_status() == 503

        class S:
            base_url = base

        status, body = post(S, "/v1/completions", {"prompt": "x", "max_tokens": 2})
        assert status == 503 and body["error"]["code"] == 503 and "not ready" in body["error"]["message"]
        # A 503 says when to try again (the openai SDK honours Retry-After).
        req = urllib.request.Request(base + "/v1/completions", data=b'{"prompt": "x", "max_tokens": 2}',
                                     headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as e:
            urllib.request.urlopen(req, timeout=10)
        assert e.value.code == 503 and int(e.value.headers["Retry-After"]) > 0
    finally:
        for p in procs:
            stop(p)


def test_a_crashed_worker_is_restarted_and_costs_no_request(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path) as s:
        worker = role(s.proc.pid, "worker")
        body = json.dumps({"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}).encode()
        req = urllib.request.Request(s.base_url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            lines = [r.readline(), r.readline()]
            os.kill(worker, signal.SIGKILL)
            lines += r.read().split(b"\n")
        events = [json.loads(line[6:]) for line in lines if line.startswith(b"data: {")]
        assert all("error" not in e for e in events), events[-1]
        assert events[-1]["choices"][0]["finish_reason"] == "length"
        wait_until(lambda: any("-m worker " in c for c in children(s.proc.pid).values()), 30, "a new worker")
        assert role(s.proc.pid, "worker") != worker
        status, out = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert status == 200 and out["usage"]["completion_tokens"] == 4
        kids = list(children(s.proc.pid))
        assert len(kids) == 3
    # SIGTERM (the fixture's stop): the launcher exits 0 and nothing is left behind.
    assert s.proc.returncode == 0
    assert all(gone(p) for p in kids)


def test_a_worker_crashing_again_at_once_ends_kvpool_serve_saying_why(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path, "--worker-restarts", "1") as s:
        first = role(s.proc.pid, "worker")
        os.kill(first, signal.SIGKILL)
        wait_until(lambda: [p for p, c in children(s.proc.pid).items() if "-m worker " in c and p != first], 30, "a new worker")
        os.kill(role(s.proc.pid, "worker"), signal.SIGKILL)  # within seconds of its start: a crash loop
        s.proc.wait(60)
        assert s.proc.returncode == 1
        said = "".join(s.output)
        assert "the worker exited 2 times in a row, each within 60 s of its start (--worker-restarts 1); giving up" in said


def test_a_scheduler_past_its_restart_limit_stops_everything_with_a_non_zero_status(tiny_checkpoint, tmp_path):
    # NOTE: a dead scheduler is restarted (tests/e2e/test_scheduler_restart_under_load.py);
    # with no restarts allowed, kvpool serve gives up, stopping every child.
    with kvpool_serve(tiny_checkpoint, tmp_path, "--scheduler-restarts", "0") as s:
        kids = list(children(s.proc.pid))
        os.kill(role(s.proc.pid, "scheduler"), signal.SIGKILL)
        s.proc.wait(60)
        assert s.proc.returncode == 1
        wait_until(lambda: all(gone(p) for p in kids), 30, "every child to stop")
    assert "the scheduler exited 1 times in a row" in "".join(s.output) and "(--scheduler-restarts 0); giving up" in "".join(s.output)


def test_a_child_refusing_a_passed_flag_at_start_is_quoted(tiny_checkpoint, tmp_path):
    # --watermark goes to the scheduler as given; the scheduler's own check refuses 1.5
    from kvtest.serve import KVPOOL

    argv = [KVPOOL, "serve", str(tiny_checkpoint), "--port", str(free_port()), "--log-dir", str(tmp_path), "--kv-cache-memory", "8MiB",
            "--device", "cpu", "--watermark", "1.5"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("kvpool serve: the scheduler exited during start-up (status 2): kvpool-scheduler: error: --watermark must be in "
            "the range [0.0, 1.0) (0.0: off), got 1.5") in proc.stdout + proc.stderr
