"""What `kvpool serve` writes to its logs under load, as vLLM does: the scheduler's
periodic stats line, each refused request with its reason, and (with
--enable-log-requests) each request received. Real processes; the fixture stops them."""

from __future__ import annotations

import time

import pytest
from kvtest.http_api import PROMPT, post
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _wait_for(path, words: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = path.read_text(errors="replace") if path.exists() else ""
        if words in text:
            return text
        assert time.monotonic() < deadline, f"{words!r} not in {path}:\n{text[-3000:]}"
        time.sleep(0.2)


def test_stats_refusals_and_requests_are_logged(tiny_checkpoint, tmp_path):
    logs = tmp_path / "logs"
    with kvpool_serve(tiny_checkpoint, logs, "--enable-log-requests", env={"VLLM_LOG_STATS_INTERVAL": "0.5"}) as s:
        status, out = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})
        assert status == 200
        status, _ = post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": -1})
        assert status == 400
        sched = _wait_for(logs / "scheduler.log", "Avg generation throughput: ")
        front = _wait_for(logs / "frontend.log", '"POST /v1/completions" 400: ')
    stats = [line for line in sched.splitlines() if "Avg prompt throughput" in line]
    assert any("Engine 000: Avg prompt throughput: " in line and "Prefix cache hit rate: " in line for line in stats), stats
    refused = [line for line in front.splitlines() if '"POST /v1/completions" 400: ' in line]
    assert len(refused) == 1 and "temperature" in refused[0], refused
    received = [line for line in front.splitlines() if "Received request " in line]
    assert len(received) == 1 and f"Received request {out['id']}: params: " in received[0], received  # the refused one was never sent


def test_without_the_flag_requests_are_not_logged_and_disable_log_stats_silences_the_stats(tiny_checkpoint, tmp_path):
    logs = tmp_path / "logs"
    with kvpool_serve(tiny_checkpoint, logs, "--disable-log-stats", env={"VLLM_LOG_STATS_INTERVAL": "0.3"}) as s:
        assert post(s, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0})[0] == 200
        time.sleep(1.5)
    assert "Received request" not in (logs / "frontend.log").read_text()
    assert "Avg prompt throughput" not in (logs / "scheduler.log").read_text()
