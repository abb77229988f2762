"""vLLM 0.32's queue limits and budget options on a live `kvpool serve`: the frontend
refuses past --max-num-queued-reqs with vLLM's 503 (its body as `vllm serve` 0.32
sends it, no Retry-After), the merged /metrics page holds vllm:admission_rejections
once, the scheduler's family with the frontend's refusal added in, and the scheduler
runs requests under --watermark and --max-num-scheduled-tokens. Real processes; the
fixture stops them, every wait is bounded."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What `vllm serve` 0.32 answered (tiny checkpoint, --max-num-queued-reqs 2, n=3), byte for byte.
VLLM_BODY = (b'{"error":{"message":"The engine is currently busy and cannot accept new requests. Please try again later '
             b'or on a different instance.","type":"Service Unavailable","param":null,"code":503}}')


def post(base_url: str, body: dict):
    req = urllib.request.Request(base_url + "/v1/completions", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), e.read()


def test_the_frontend_refuses_as_vllm_and_the_page_counts_it_once(tiny_checkpoint, tmp_path):
    flags = ("--served-model-name", "m", "--max-model-len", "256", "--max-num-queued-reqs", "2", "--watermark", "0.1",
             "--max-num-scheduled-tokens", "8")
    with kvpool_serve(tiny_checkpoint, tmp_path, *flags) as served:
        status, headers, body = post(served.base_url, {"model": "m", "prompt": [5, 6, 7], "max_tokens": 2, "n": 3})
        assert (status, body) == (503, VLLM_BODY) and "Retry-After" not in headers
        # a 20-token prompt in 8-token steps (--max-num-scheduled-tokens 8), 2 samples: 0 + 2 <= 2
        status, _, body = post(served.base_url, {"model": "m", "prompt": list(range(5, 25)), "max_tokens": 3, "n": 2})
        assert status == 200 and [c["finish_reason"] for c in json.loads(body)["choices"]] == ["length", "length"]
        with urllib.request.urlopen(served.base_url + "/metrics", timeout=30) as r:
            page = r.read().decode()
    lines = page.splitlines()
    assert lines.count("# TYPE vllm:admission_rejections_total counter") == 1
    assert 'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_reqs"} 1.0' in lines
    assert 'vllm:admission_rejections_total{model_name="m",reason="max_num_queued_tokens"} 0.0' in lines
