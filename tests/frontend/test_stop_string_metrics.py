"""A request a stop string ends (the frontend sees the stop string and aborts its
engine request) is a finished request in the scheduler's per-request histograms, as
vLLM's output processor records it; one the client abandons is not."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from kvtest.http_api import PROMPT, get_metrics, metric

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# vLLM records these for every finished request, stop-string ones included.
PER_REQUEST = ("vllm:e2e_request_latency_seconds_count", "vllm:request_queue_time_seconds_count",
               "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
               "vllm:request_inference_time_seconds_count", "vllm:request_time_per_output_token_seconds_count",
               "vllm:request_num_preemptions_count", "vllm:request_prefill_kv_computed_tokens_count")


STOPPED = "stop successes"


def counts(served) -> dict[str, float]:
    text = get_metrics(served)
    got = {name: metric(text, name) for name in PER_REQUEST}
    got[STOPPED] = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total{") and 'finished_reason="stop"' in line)
    return got


def complete(served, body: dict) -> str:
    """The completion's text, streamed or not."""
    req = urllib.request.Request(served.base_url + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        raw = r.read().decode()
    if not body.get("stream"):
        return json.loads(raw)["choices"][0]["text"]
    chunks = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: {")]
    return "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


def settled_counts(served, before: dict[str, float], timeout: float = 30.0) -> dict[str, float]:
    """The counts once the stop's abort reached the scheduler (bounded wait)."""
    deadline = time.monotonic() + timeout
    while True:
        now = counts(served)
        if all(now[n] > before[n] for n in PER_REQUEST) or time.monotonic() > deadline:
            return now
        time.sleep(0.2)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_string_finish_is_counted_as_vllm_counts_it(served, model, stream):
    body = {"model": model, "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
    free = complete(served, body)
    assert len(free) > 4, free
    # a stop string the greedy text reaches: its 3rd and 4th characters (the same tokens again)
    stop = free[2:4]
    before = counts(served)
    assert complete(served, {**body, "stop": [stop], "stream": stream}) == free[: free.index(stop)]
    after = settled_counts(served, before)
    for name in (STOPPED, *PER_REQUEST):
        assert after[name] == before[name] + 1, name
