"""A request's priority, from the HTTP body (or vLLM's X-Vllm-Priority header) through
the frontend's Generate to the scheduler's waiting queue, on a live `kvpool serve`
with one request running at a time: under --scheduling-policy priority the queued
request with the lower value runs first, whatever the arrival order; under fcfs the
field is accepted and changes nothing (vLLM 0.32). Real processes; the fixture stops
them, every wait is bounded."""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest
from kvtest.http_api import PROMPT
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def complete(served, body: dict, headers: dict | None = None) -> dict:
    req = urllib.request.Request(served.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200
        return json.loads(r.read())


def finish_order(served, model: str) -> tuple[list[str], dict[str, float]]:
    """A long request runs; then "late-low" (priority 5 in the body) and "later-high"
    (-5 by header, 0 in the body) queue behind it, in that order. Returns the order
    the two finished in, and when each event happened."""
    times: dict[str, float] = {}
    order: list[str] = []
    lock = threading.Lock()

    def run(name: str, body: dict, headers: dict | None = None) -> None:
        complete(served, {"model": model, "prompt": PROMPT, "temperature": 0, **body}, headers)
        with lock:
            times[name] = time.monotonic()
            order.append(name)

    long = threading.Thread(target=run, args=("long", {"max_tokens": 600, "ignore_eos": True}))
    long.start()
    time.sleep(0.3)  # the long one is admitted first (one running at a time)
    low = threading.Thread(target=run, args=("late-low", {"max_tokens": 2, "priority": 5}))
    low.start()
    time.sleep(0.2)
    times["sent"] = time.monotonic()
    high = threading.Thread(target=run, args=("later-high", {"max_tokens": 2}), kwargs={"headers": {"X-Vllm-Priority": "-5"}})
    high.start()
    for t in (long, low, high):
        t.join(180)
        assert not t.is_alive()
    assert order[0] == "long" and times["long"] > times["sent"], "the long request ended before both were queued"
    return order[1:], times


def test_the_lower_priority_value_runs_first_under_the_priority_policy(tiny_checkpoint, tmp_path):
    args = ("--max-model-len", "1024", "--scheduling-policy", "priority", "--max-num-seqs", "1")
    with kvpool_serve(tiny_checkpoint, tmp_path, *args) as served:
        order, _ = finish_order(served, str(tiny_checkpoint))
    assert order == ["later-high", "late-low"]


def test_fcfs_accepts_the_field_and_keeps_arrival_order(tiny_checkpoint, tmp_path):
    with kvpool_serve(tiny_checkpoint, tmp_path, "--max-model-len", "1024", "--max-num-seqs", "1") as served:
        order, _ = finish_order(served, str(tiny_checkpoint))
    assert order == ["late-low", "later-high"]


def test_the_prefill_options_keep_greedy_outputs(tiny_checkpoint, tmp_path):
    # The cap and unsplit prompts change when tokens are computed, never which.
    body = {"model": str(tiny_checkpoint), "prompt": [PROMPT, PROMPT[:40]], "max_tokens": 12, "temperature": 0}
    texts = []
    for i, args in enumerate([(), ("--no-enable-chunked-prefill", "--long-prefill-token-threshold", "8", "--max-num-batched-tokens", "1024")]):
        with kvpool_serve(tiny_checkpoint, tmp_path / str(i), "--max-model-len", "1024", *args) as served:
            texts.append([c["text"] for c in complete(served, body)["choices"]])
    assert texts[0] == texts[1] and all(texts[0])
