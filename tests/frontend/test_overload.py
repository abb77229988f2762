"""Overload is the server's state, not the request's fault: a full waiting queue is
503 with Retry-After through the API (as vLLM answers overload), which the openai SDK
and routers retry, and nothing is left held. Real processes; the fixture stops them."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from kvtest.http_api import PROMPT, get_metrics, metric
from kvtest.serve import kvpool_serve

from frontend.engine.outputs import EngineError
from frontend.openai.serving import engine_error

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


@pytest.mark.parametrize(
    ("message", "status"),
    [
        ("the waiting queue is full (2 requests, --max-num-waiting): try again later", 503),
        ("the scheduler is shutting down", 503),
        ("no worker returned within 30 s", 503),
        ("lost the connection to the scheduler at tcp://127.0.0.1:1", 503),
        ("prompt has token id 999 outside the vocabulary", 400),
    ],
)
def test_refusals_of_the_servers_state_are_503(message, status):
    assert engine_error(EngineError(message)).status.value == status


def _complete(base_url: str, body: dict) -> tuple[int, dict, dict]:
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _wait(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def test_a_full_waiting_queue_is_503_with_retry_after(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path, "--max-num-seqs", "1", "--scheduler-args", "--max-num-waiting 1") as s:
        long = {"prompt": PROMPT, "max_tokens": 800, "temperature": 0, "ignore_eos": True}
        results: list = []
        # One runs, one waits; then the queue is full.
        threads = [threading.Thread(target=lambda: results.append(_complete(s.base_url, long))) for _ in range(2)]
        threads[0].start()
        _wait(lambda: metric(get_metrics(s), "vllm:num_requests_running") == 1, "the first to run")
        threads[1].start()
        _wait(lambda: metric(get_metrics(s), "vllm:num_requests_waiting") == 1, "the second to wait")
        status, headers, body = _complete(s.base_url, {"prompt": PROMPT, "max_tokens": 2, "temperature": 0})
        for t in threads:
            t.join(120)
        assert status == 503, body
        assert "waiting queue is full" in body["error"]["message"] and int(headers["Retry-After"]) > 0
        assert sorted(r[0] for r in results) == [200, 200]  # the admitted two were served
