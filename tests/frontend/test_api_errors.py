"""Bad requests get OpenAI's error object with the right status and vLLM's wording,
change nothing, and the server keeps serving; nothing leaks (no engine request left
open, no block held)."""

from __future__ import annotations

import json
import socket
import time
import urllib.error
import urllib.request

import pytest
from kvtest.http_api import PROMPT, get_metrics, metric, post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def error_of(status_body, status: int):
    got, body = status_body
    assert got == status, body
    assert set(body["error"]) == {"message", "type", "param", "code"} and body["error"]["code"] == status
    return body["error"]


def assert_idle(served, timeout: float = 30.0):
    """Bounded wait for: no engine request open, no running request, no block held."""
    deadline = time.monotonic() + timeout
    while True:
        text = get_metrics(served)
        state = (metric(text, "kvpool_frontend_engine_requests_in_flight"), metric(text, "vllm:num_requests_running"),
                 metric(text, "vllm:kv_cache_usage_perc"))
        if state == (0, 0, 0):
            return
        assert time.monotonic() < deadline, f"not idle after {timeout} s: in flight, running, usage = {state}"
        time.sleep(0.2)


def test_unknown_model_is_404(served):
    e = error_of(post(served, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404)
    assert e["message"] == "The model `gpt-4` does not exist." and e["type"] == "NotFoundError" and e["param"] == "model"


def test_prompt_over_the_context_length_uses_vllms_wording(served, model):
    # vLLM 0.32's renderer (checked against a live vllm serve): the prompt alone must fit;
    # a token prompt one over the context reads "at least", as its text tokenization stops there.
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": [7] * 1100, "max_tokens": 1}), 400)
    assert e["message"] == ("This model's maximum context length is 1024 tokens. However, your prompt contains 1100 input "
                            "tokens, which exceeds this limit even without any output tokens. Please reduce the length of "
                            "the input prompt. (parameter=input_tokens, value=1100)") and e["param"] == "input_tokens"
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": [7] * 1025, "max_tokens": 1}), 400)
    assert "your prompt contains at least 1025 input tokens" in e["message"]
    # A prompt that fills the context leaves no output: vLLM's get_max_tokens gives 0.
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": [7] * 1024, "max_tokens": 1}), 400)
    assert e["message"] == "max_tokens must be at least 1, got 0." and e["param"] == "max_tokens"
    # An output budget over the whole context is refused before tokenizing.
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": 2000}), 400)
    assert e["message"] == ("max_tokens=2000 cannot be greater than max_model_len=1024. Please request fewer output "
                            "tokens. (parameter=max_tokens, value=2000)") and e["param"] == "max_tokens"
    e = error_of(post(served, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "x"}],
                                                        "max_completion_tokens": 2000}), 400)
    assert e["param"] == "max_completion_tokens" and e["message"].startswith("max_completion_tokens=2000 cannot be greater")


def test_an_output_budget_over_what_the_prompt_leaves_gets_what_is_left(served, model):
    # vLLM 0.32 answers 200 and generates at most the context's rest (get_max_tokens).
    status, body = post(served, "/v1/completions", {"model": model, "prompt": [5] * 1000, "max_tokens": 100,
                                                    "ignore_eos": True, "temperature": 0})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 24 and body["choices"][0]["finish_reason"] == "length"


def test_a_text_longer_than_the_context_could_hold_is_refused_before_tokenizing(served, model):
    from frontend.text.tokenizer import Tokenizer

    longest = Tokenizer(model).max_chars_per_token  # vLLM's bound: max_model_len tokens of the longest token
    text = "a" * (1024 * longest + 1)
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": text, "max_tokens": 1}), 400)
    assert e["param"] == "input_text" and f"contains {len(text)} characters (more than {1024 * longest} characters" in e["message"]


@pytest.mark.parametrize(
    ("body", "param", "needle"),
    [
        ({"max_tokens": -3}, "max_tokens", "max_tokens must be at least 1, got -3."),
        ({"temperature": -1}, "temperature", "temperature must be non-negative"),
        ({"top_p": 0}, "top_p", "top_p must be in (0, 1]"),
        ({"n": 0}, "n", "n must be at least 1"),
        ({"n": 16385}, "n", "n must be at most 16384, got 16385. To increase this limit, set the VLLM_MAX_N_SEQUENCES"),
        ({"logprobs": 21}, "logprobs", "greater than max allowed: 20"),
        ({"min_tokens": 99, "max_tokens": 4}, "min_tokens", "min_tokens must be less than or equal to max_tokens=4"),
        ({"prompt": [10**6]}, "prompt", "Token id 1000000 is out of vocabulary"),
        ({"prompt": []}, "prompt", "Prompt cannot be empty"),
        ({"prompt": [1.5]}, "prompt", "prompt must be a string"),
    ],
)
def test_invalid_parameters_are_named(served, model, body, param, needle):
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": "x", **body}), 400)
    assert needle in e["message"] and e["param"] == param


def test_malformed_json_and_wrong_types(served, model):
    assert "JSON decode error" in error_of(post(served, "/v1/completions", b'{"prompt": "x",'), 400)["message"]
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": "x", "max_tokens": "ten"}), 400)
    assert "$.max_tokens" in e["message"]
    e = error_of(post(served, "/v1/chat/completions", {"model": model, "messages": "hi"}), 400)
    assert "$.messages" in e["message"]
    e = error_of(post(served, "/v1/chat/completions", {"model": model, "messages": [{"content": "no role"}]}), 400)
    assert "no role" in e["message"]


def test_a_10_mb_prompt_is_refused_with_413(served, model):
    e = error_of(post(served, "/v1/completions", {"model": model, "prompt": "a" * (10 << 20)}), 413)
    assert "too large" in e["message"]


def test_unknown_route_is_an_error_object(served):
    req = urllib.request.Request(served.base_url + "/v1/nothing-here")
    try:
        urllib.request.urlopen(req, timeout=10)
        raise AssertionError("expected 404")
    except urllib.error.HTTPError as e:
        assert e.code == 404 and json.loads(e.read())["error"]["code"] == 404


def test_a_flood_of_idle_connections_does_not_stop_the_server(served, model):
    socks = []
    try:
        for _ in range(300):
            s = socket.create_connection(("127.0.0.1", served.port), timeout=10)
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{")  # never finished
            socks.append(s)
        status, body = post(served, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 3, "temperature": 0})
        assert status == 200 and body["usage"]["completion_tokens"] == 3
    finally:
        for s in socks:
            s.close()
    status, _ = post(served, "/v1/completions", {"model": model, "prompt": "after", "max_tokens": 2})
    assert status == 200


def test_after_every_bad_request_nothing_is_left_open(served):
    assert_idle(served)


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(served, model):
    body = json.dumps({"model": model, "prompt": PROMPT * 4, "max_tokens": 800, "temperature": 0, "ignore_eos": True,
                       "stream": True}).encode()
    s = socket.create_connection(("127.0.0.1", served.port), timeout=30)
    try:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        got = b""
        while got.count(b"data: ") < 3:
            chunk = s.recv(65536)
            assert chunk, "the server closed the stream early"
            got += chunk
        text = get_metrics(served)
        assert metric(text, "vllm:num_requests_running") == 1 and metric(text, "vllm:kv_cache_usage_perc") > 0
    finally:
        s.close()
    assert_idle(served)
    text = get_metrics(served)
    assert metric(text, 'vllm:request_success_total{engine="0",finished_reason="abort"') >= 0  # the family exists


def test_metrics_page_has_the_scheduler_and_the_frontend_under_vllm_names(served, model):
    # NOTE: a request of its own, so the page has a finished request whatever ran before.
    assert post(served, "/v1/completions", {"model": model, "prompt": PROMPT, "max_tokens": 2})[0] == 200
    text = get_metrics(served)
    for name in ("vllm:kv_cache_usage_perc", "vllm:prefix_cache_queries_total", "vllm:num_requests_running",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:request_success_total",
                 "vllm:request_prompt_tokens_bucket", "http_requests_total"):
        assert metric(text, name) >= 0 and name in text, name
    assert metric(text, "vllm:request_success_total") > 0
    names = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE ")]
    assert len(names) == len(set(names)), "a metric family appears twice"


def test_the_dashboard_and_alerts_find_their_metrics_on_the_api_port(served):
    """deploy/'s dashboard and alert rules, pointed at kvpool serve's :8000, find every
    metric they use there (the worker's own, and the residency histograms that need
    --kv-cache-metrics, are elsewhere)."""
    from kvtest.deploy_config import (
        FRONTEND,
        PROM,
        dashboard_metric_names,
        metric_names,
        rule_exprs,
    )
    from prometheus_client.parser import text_string_to_metric_families

    real = {s.name for f in text_string_to_metric_families(get_metrics(served)) for s in f.samples} | {"up"}
    used = dashboard_metric_names().union(*(metric_names(e) for e in rule_exprs(PROM / "rules.yml")))
    used = {n for n in used if not n.startswith(("kvpool_worker_", "vllm:kv_block_"))}
    assert FRONTEND <= real
    assert used <= real, f"not on the API's /metrics: {sorted(used - real)}"


def test_dev_mode_reset_prefix_cache(served):
    req = urllib.request.Request(served.base_url + "/reset_prefix_cache", data=b"", method="POST")
    assert urllib.request.urlopen(req, timeout=10).status == 200
