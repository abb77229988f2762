"""The frontend's vllm:* families against vLLM 0.32's PrometheusStatLogger (names, types,
labels, buckets and help written here from vllm/v1/metrics/loggers.py and buckets.py),
and what they count, per engine request and per prompt (vLLM's ParentRequest), as
vLLM's output processor counts them."""

from __future__ import annotations

import json
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from frontend.http.metrics import ChoiceGroups, FrontendMetrics

INF = float("inf")
TOKENS_100 = (1, 2, 5, 10, 20, 50, 100)  # build_1_2_5_buckets(100)
ENGINE = {"model_name", "engine"}
FAMILIES = {
    "vllm:request_success": ("counter", ENGINE | {"finished_reason"}, None, "Count of successfully processed requests."),
    "vllm:request_prompt_tokens": ("histogram", ENGINE, TOKENS_100, "Number of prefill tokens processed."),
    "vllm:request_generation_tokens": ("histogram", ENGINE, TOKENS_100, "Number of generation tokens processed."),
    "vllm:request_max_num_generation_tokens": ("histogram", ENGINE, TOKENS_100,
                                               "Histogram of maximum number of requested generation tokens."),
    "vllm:request_params_n": ("histogram", ENGINE, (1, 2, 5, 10, 20), "Histogram of the n request parameter."),
    "vllm:request_params_max_tokens": ("histogram", ENGINE, TOKENS_100, "Histogram of the max_tokens request parameter."),
}
LABELS = {"model_name": "m", "engine": "0"}


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_family_is_vllms(name):
    kind, labels, buckets, doc = FAMILIES[name]
    m = FrontendMetrics("m", max_model_len=100)
    family = {f.name: f for f in text_string_to_metric_families(m.render().decode())}[name]
    assert family.type == kind and family.documentation == doc
    samples = [s for s in family.samples if not s.name.endswith("_created")]
    assert samples and all(set(s.labels) - {"le"} == labels for s in samples)
    if buckets is not None:
        assert [float(s.labels["le"]) for s in samples if s.name.endswith("_bucket")] == [*map(float, buckets), INF]
    if name == "vllm:request_success":  # vLLM's FinishReason, every one from the start
        assert {s.labels["finished_reason"] for s in samples} == {"stop", "length", "abort", "error", "repetition"}


def test_n_and_the_longest_output_count_per_prompt_once_all_its_choices_end():
    m = FrontendMetrics("m", max_model_len=100)
    get = m.registry.get_sample_value
    # Two prompts (5 and 7 tokens), n=2, max_tokens 30: choices 0, 1 are prompt 0's.
    groups = ChoiceGroups(m, 2, 2, 30)
    groups.finished(1, "length", 5, 30)
    groups.finished(2, "stop", 7, 4)
    assert get("vllm:request_params_n_count", LABELS) == 0  # no prompt has both its choices yet
    groups.finished(0, "stop", 5, 12)
    assert get("vllm:request_params_n_count", LABELS) == 1 and get("vllm:request_params_n_sum", LABELS) == 2
    assert get("vllm:request_max_num_generation_tokens_sum", LABELS) == 30
    groups.finished(3, "stop", 7, 9)
    assert get("vllm:request_params_n_count", LABELS) == 2 and get("vllm:request_params_n_sum", LABELS) == 4
    assert get("vllm:request_max_num_generation_tokens_count", LABELS) == 2
    assert get("vllm:request_max_num_generation_tokens_sum", LABELS) == 30 + 9
    assert get("vllm:request_max_num_generation_tokens_bucket", {**LABELS, "le": "20.0"}) == 1  # the 9
    # Per engine request: four of each.
    assert get("vllm:request_params_max_tokens_count", LABELS) == 4 and get("vllm:request_params_max_tokens_sum", LABELS) == 120
    assert get("vllm:request_prompt_tokens_sum", LABELS) == 5 + 7 + 5 + 7
    assert get("vllm:request_generation_tokens_sum", LABELS) == 30 + 4 + 12 + 9
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": "stop"}) == 3
    assert get("vllm:request_success_total", {**LABELS, "finished_reason": "length"}) == 1


@pytest.mark.e2e
@pytest.mark.slow
def test_a_served_chat_request_with_n_2(served, model):
    def sample(text: str, name: str) -> float:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == name:
                    return s.value
        raise KeyError(name)

    def page() -> str:
        with urllib.request.urlopen(served.base_url + "/metrics", timeout=10) as r:
            return r.read().decode()

    names = ("vllm:request_params_n_sum", "vllm:request_params_n_count", "vllm:request_params_max_tokens_sum",
             "vllm:request_params_max_tokens_count", "vllm:request_max_num_generation_tokens_sum",
             "vllm:request_generation_tokens_sum")
    before = page()
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "n": 2,
                       "ignore_eos": True, "temperature": 1.0, "seed": 3}).encode()  # n > 1 samples, as vLLM requires
    req = urllib.request.Request(served.base_url + "/v1/chat/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert len(json.loads(r.read())["choices"]) == 2
    after = page()
    delta = {n: sample(after, n) - sample(before, n) for n in names}
    assert delta == {
        "vllm:request_params_n_sum": 2, "vllm:request_params_n_count": 1, "vllm:request_params_max_tokens_sum": 10,
        "vllm:request_params_max_tokens_count": 2, "vllm:request_max_num_generation_tokens_sum": 5,
        "vllm:request_generation_tokens_sum": 10,
    }


def http_counts(m: FrontendMetrics) -> dict[str, float]:
    family = {f.name: f for f in text_string_to_metric_families(m.render().decode())}["http_requests"]
    return {s.labels["handler"]: s.value for s in family.samples if s.name == "http_requests_total"}


def test_http_requests_leave_out_the_handlers_vllm_leaves_out():
    # vLLM's Instrumentator(excluded_handlers=["/metrics", "/health", "/load", "/ping", "/version",
    # "/server_info"]), each a regex searched in the route: /health_generate is left out too.
    m = FrontendMetrics("m", max_model_len=100)
    for handler in ("/v1/completions", "/metrics", "/health", "/health_generate", "/load", "/ping", "/version",
                    "/server_info", "/get_server_info", "/tokenize", "/v1/completions"):
        m.http_request("POST", handler, 200, 0.01)
    # "/server_info" is not in "/get_server_info" (the router probe): that one counts
    assert http_counts(m) == {"/v1/completions": 2.0, "/get_server_info": 1.0, "/tokenize": 1.0}
