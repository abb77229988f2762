"""--custom-histogram-buckets in the scheduler: vLLM 0.32's JSON mapping, family ->
bounds (vllm/config/observability.py), checked in vLLM's words; a family given replaces
the bounds of every histogram of it, the others keep vLLM's. The frontend's families
(request_params_n, request_tokens) are refused by name. Expected bounds written here."""

from __future__ import annotations

import argparse

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scheduler.engine.args import config_from_args
from scheduler.engine.metric_buckets import custom_histogram_buckets
from scheduler.engine.metrics import SchedulerMetrics

INF = float("inf")
LATENCY_FAMILY = ("vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds", "vllm:request_inference_time_seconds",
                  "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds")
RESIDENCY_FAMILY = ("vllm:kv_block_lifetime_seconds", "vllm:kv_block_idle_before_evict_seconds", "vllm:kv_block_reuse_gap_seconds")


def bounds(m: SchedulerMetrics) -> dict[str, list[float]]:
    families = text_string_to_metric_families(m.render().decode())
    return {f.name: [float(s.labels["le"]) for s in f.samples if s.name.endswith("_bucket")] for f in families if f.type == "histogram"}


def test_a_family_given_replaces_every_histogram_of_it_and_only_it():
    custom = custom_histogram_buckets('{"request_latency": [0.01, 0.05, 0.1, 0.5], "iteration_tokens": [4, 64]}')
    got = bounds(SchedulerMetrics("m", custom_buckets=custom))
    for name in LATENCY_FAMILY:
        assert got[name] == [0.01, 0.05, 0.1, 0.5, INF], name
    assert got["vllm:iteration_tokens_total"] == [4.0, 64.0, INF]
    # not given: vLLM's defaults
    assert got["vllm:time_to_first_token_seconds"][:3] == [0.001, 0.005, 0.01]
    assert got["vllm:request_num_preemptions"] == [1.0, 2.0, 3.0, 4.0, 5.0, 10.0, 20.0, INF]
    assert got == {**bounds(SchedulerMetrics("m")), **{n: got[n] for n in (*LATENCY_FAMILY, "vllm:iteration_tokens_total")}}


def test_the_residency_family_reaches_the_kv_cache_metrics():
    custom = custom_histogram_buckets('{"kv_cache_residency": [1, 60]}')
    got = bounds(SchedulerMetrics("m", kv_cache_metrics=True, custom_buckets=custom))
    for name in RESIDENCY_FAMILY:
        assert got[name] == [1.0, 60.0, INF], name


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ('{"latency": [1]}', "custom_histogram_buckets: unknown bucket family 'latency'; known families: "
                             "['inter_token_latency', 'iteration_tokens', 'kv_cache_residency', 'request_latency', "
                             "'request_num_preemptions', 'request_params_n', 'request_tokens', 'time_to_first_token']"),
        ('{"request_latency": []}', "custom_histogram_buckets['request_latency']: bucket list must not be empty"),
        ('{"request_latency": [0, 1]}', "custom_histogram_buckets['request_latency']: bound 0.0 must be finite and greater than 0"),
        ('{"request_latency": [1, Infinity]}', "custom_histogram_buckets['request_latency']: bound inf must be finite and greater than 0"),
        ('{"request_latency": [1, 1]}', "custom_histogram_buckets['request_latency']: bounds [1.0, 1.0] must be strictly increasing"),
        ('{"request_latency": [2, 1.5]}', "custom_histogram_buckets['request_latency']: bounds [2.0, 1.5] must be strictly increasing"),
        ('{"request_latency": [1, true]}', "custom_histogram_buckets['request_latency']: bound True must be a number, not a boolean"),
        ('{"request_latency": ["1"]}', "custom_histogram_buckets['request_latency']: must be a list of numbers, got ['1']"),
        ('{"request_tokens": [1, 10]}', "custom_histogram_buckets['request_tokens']: kvpool does not support overriding this family yet"),
        ('{"request_params_n": [1, 2]}', "custom_histogram_buckets['request_params_n']: kvpool does not support overriding"),
        ("[1, 2]", "custom_histogram_buckets: must be a JSON object"),
        ("{request_latency: [1]}", "not JSON: "),
    ],
)
def test_bad_values_are_refused_naming_the_problem(text, message, capsys):
    with pytest.raises(argparse.ArgumentTypeError) as e:
        custom_histogram_buckets(text)
    assert message in str(e.value)
    with pytest.raises(SystemExit) as exit_:
        config_from_args(["--custom-histogram-buckets", text])
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_the_scheduler_process_reads_the_flag():
    assert config_from_args([]).custom_histogram_buckets is None
    c = config_from_args(["--custom-histogram-buckets", '{"time_to_first_token": [0.1, 1]}'])
    assert c.custom_histogram_buckets == {"time_to_first_token": (0.1, 1.0)}
