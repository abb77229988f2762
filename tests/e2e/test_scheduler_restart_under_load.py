"""The scheduler or the frontend SIGKILLed under load is restarted, and the service goes
on. The load is the issue's repro: `python -m loadgen --backend openai --request-rate 40
--num-requests 200` through `kvpool serve` of the tiny checkpoint, one process killed
2 s in. A killed scheduler costs no request (the frontend gives the next one every
request in flight, with the tokens already streamed); a killed frontend cuts its
clients' open connections (the SDK's retries and later requests then succeed) and leaks
nothing in the scheduler. Real processes, real sockets; every process is stopped by the
fixtures."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.request

import pytest
from kvtest.openai_load import openai_load
from kvtest.procs import children
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _child(serve_pid: int, module: str) -> int:
    (pid,) = [p for p, cmd in children(serve_pid).items() if f"-m {module} " in cmd]
    return pid


def _complete(base_url: str, prompt: str) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        return json.loads(r.read())


def _scrape(base_url: str, family: str) -> float:
    with urllib.request.urlopen(base_url + "/metrics", timeout=10) as r:
        page = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.splitlines() if line.startswith(family + "{"))


def _kill_during_load(s, module: str, result, lossless: bool = True) -> str:
    lg = openai_load(s.base_url, result)
    try:
        time.sleep(2.0)  # the load is running: some requests in flight, most still to come
        victim = _child(s.proc.pid, module)
        os.kill(victim, signal.SIGKILL)
        out, _ = lg.communicate(timeout=240)
    finally:
        if lg.poll() is None:
            lg.kill()
            lg.wait(10)
    assert lg.returncode == 0 or not lossless, out + s.logs()
    # It was a real restart: a new process, and kvpool serve said so.
    assert _child(s.proc.pid, module) != victim
    said = "".join(s.output)
    assert f"the {module} exited (status -9); restarting it" in said, said
    return out


def test_a_killed_scheduler_under_load_costs_no_request(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--dtype", "float32", "--served-model-name", "tiny") as s:
        before = _complete(s.base_url, "The same prompt before and after")
        out = _kill_during_load(s, "scheduler", tmp_path / "r.json")
        r = json.loads((tmp_path / "r.json").read_text())
        assert (r["completed"], r["failed"]) == (200, 0), out + s.logs()
        # Every request got all its tokens (the load's default: 32 each, EOS ignored), the
        # resumed ones included: none lost or repeated across the restart.
        assert r["total_output_tokens"] == 200 * 32, r
        # The frontend resumed requests on the new scheduler, and the worker handshook again.
        frontend_log = (s.log_dir / "frontend.log").read_text()
        worker_log = (s.log_dir / "worker.log").read_text()
        assert "is back after" in frontend_log and "resuming" in frontend_log, frontend_log[-3000:]
        assert "lost the connection to the scheduler" in worker_log and "handshaking again" in worker_log, worker_log
        # A request afterwards answers, greedy as before the kill.
        after = _complete(s.base_url, "The same prompt before and after")
        assert after["choices"][0]["text"] == before["choices"][0]["text"]
        assert s.proc.poll() is None


def test_a_killed_frontend_under_load_is_restarted_and_leaks_nothing(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--dtype", "float32", "--served-model-name", "tiny") as s:
        out = _kill_during_load(s, "frontend", tmp_path / "r.json", lossless=False)
        r = json.loads((tmp_path / "r.json").read_text())
        # Only the requests open at the kill fail (their connections are cut): those that
        # connect while the frontend restarts wait in kvpool serve's listening socket's
        # backlog for the next one. The load's own log says how many were open.
        assert r["completed"] + r["failed"] == 200, out
        errors = r["errors"]
        cut = ("ClientPayloadError", "ServerDisconnectedError", "ClientOSError")
        assert r["failed"] == sum(n for e, n in errors.items() if e.startswith(cut)), errors
        deadline = time.monotonic() + 30
        while True:
            try:
                _complete(s.base_url, "after the frontend came back")
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        # The killed frontend's requests were freed in the scheduler: nothing runs or waits.
        deadline = time.monotonic() + 30
        while (_scrape(s.base_url, "vllm:num_requests_running") + _scrape(s.base_url, "vllm:num_requests_waiting")) > 0:
            assert time.monotonic() < deadline, "requests of the killed frontend still held by the scheduler"
            time.sleep(0.2)
        assert _scrape(s.base_url, "vllm:kv_cache_usage_perc") == 0.0
        assert s.proc.poll() is None
