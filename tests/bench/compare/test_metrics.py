"""make compare's metrics row (bench/compare/metrics.py) on hand-written exposition pages:
what is read of each family, every way two families can differ, the accepted reasons,
the row and the lines under the table; the CLI on two saved pages; and a live `kvpool
serve`, started as vLLM was for the saved reference page, against that page."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest.http_api import PROMPT, get_metrics, post
from kvtest.serve import kvpool_serve

from bench.compare.metrics import (
    ACCEPTED,
    Family,
    diff,
    families,
    format_differences,
    metrics_report,
    metrics_row,
    report,
)

ROOT = Path(__file__).resolve().parents[3]
REFERENCE = ROOT / "tests/deploy/data/vllm-0.32-metrics.txt"
# A reason of the tests' own: ACCEPTED itself may be empty.
REASONS = {"vllm:mm_cache_hits": "multimodal cache: not served here"}

# The shapes a vLLM page has: a histogram, counters with _total and their _created gauge
# families (as prometheus_client writes them), a gauge labelled by a kind, an info gauge.
PAGE = """\
# HELP vllm:e2e_request_latency_seconds Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds histogram
vllm:e2e_request_latency_seconds_sum{engine="0",model_name="tiny"} 1.5
vllm:e2e_request_latency_seconds_bucket{engine="0",le="0.3",model_name="tiny"} 1.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="2.5",model_name="tiny"} 2.0
vllm:e2e_request_latency_seconds_bucket{engine="0",le="+Inf",model_name="tiny"} 2.0
vllm:e2e_request_latency_seconds_count{engine="0",model_name="tiny"} 2.0
# HELP vllm:e2e_request_latency_seconds_created Histogram of e2e request latency in seconds.
# TYPE vllm:e2e_request_latency_seconds_created gauge
vllm:e2e_request_latency_seconds_created{engine="0",model_name="tiny"} 1.7e+09
# HELP vllm:request_success_total Count of successfully processed requests.
# TYPE vllm:request_success_total counter
vllm:request_success_total{engine="0",finished_reason="stop",model_name="tiny"} 3.0
vllm:request_success_total{engine="0",finished_reason="length",model_name="tiny"} 5.0
vllm:request_success_total{engine="0",finished_reason="abort",model_name="tiny"} 0.0
# HELP vllm:request_success_created Count of successfully processed requests.
# TYPE vllm:request_success_created gauge
vllm:request_success_created{engine="0",finished_reason="stop",model_name="tiny"} 1.7e+09
vllm:request_success_created{engine="0",finished_reason="length",model_name="tiny"} 1.7e+09
vllm:request_success_created{engine="0",finished_reason="abort",model_name="tiny"} 1.7e+09
# HELP vllm:num_requests_waiting_by_reason Number of requests waiting, by reason.
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 0.0
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="deferred"} 0.0
# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="64"} 1.0
# HELP http_requests_total Total number of requests by method, status and handler.
# TYPE http_requests_total counter
http_requests_total{handler="/v1/completions",method="POST",status="2xx"} 8.0
"""


def test_the_parser_reads_type_labels_kind_values_buckets_and_samples():
    fams = families(PAGE)
    # Only vllm:* families, and no _created family of its own.
    assert sorted(fams) == ["vllm:cache_config_info", "vllm:e2e_request_latency_seconds",
                            "vllm:num_requests_waiting_by_reason", "vllm:request_success"]
    h = fams["vllm:e2e_request_latency_seconds"]
    assert h == Family("histogram", ("engine", "model_name"), {}, (0.3, 2.5, float("inf")),
                       ("_bucket", "_count", "_created", "_sum"))
    c = fams["vllm:request_success"]
    assert c.type == "counter" and c.labels == ("engine", "finished_reason", "model_name")
    assert c.values == {"finished_reason": ("abort", "length", "stop")}  # model_name, engine: identity
    assert c.samples == ("_created", "_total") and c.buckets == ()
    g = fams["vllm:num_requests_waiting_by_reason"]
    assert g.type == "gauge" and g.values == {"reason": ("capacity", "deferred")} and g.samples == ("",)
    # An info gauge's label values are settings, never compared; its label names are.
    i = fams["vllm:cache_config_info"]
    assert i.labels == ("block_size", "engine", "num_gpu_blocks") and i.values == {}


def test_a_counter_without_its_created_series_differs_in_samples():
    # NOTE: prometheus_client writes a counter's TYPE line under its _total name.
    text = "# TYPE vllm:prompt_tokens_total counter\nvllm:prompt_tokens_total 4.0\n"
    created = "# TYPE vllm:prompt_tokens_created gauge\nvllm:prompt_tokens_created 1.7e+09\n"
    assert families(text)["vllm:prompt_tokens"].samples == ("_total",)
    assert families(text + created)["vllm:prompt_tokens"].samples == ("_created", "_total")
    # A _created gauge with no counter of that name is a family of its own.
    assert families(created)["vllm:prompt_tokens_created"].type == "gauge"
    (d,) = diff(families(PAGE + text + created), families(PAGE + text), accepted={})
    assert (d.family, d.what, d.vllm, d.kvpool, d.reason) == ("vllm:prompt_tokens", "samples", "_created, _total", "_total", None)


def test_equal_pages_have_no_difference_whatever_the_values_and_identity():
    other = PAGE.replace(" 3.0", " 30.0").replace('model_name="tiny"', 'model_name="kvpool-tiny"')
    assert diff(families(PAGE), families(other)) == []
    doc = report(PAGE, other)
    assert (doc["num_vllm_families"], doc["num_listed"], doc["num_unlisted"], doc["differences"]) == (4, 0, 0, [])
    assert metrics_row(doc)["met"] is True


def test_every_kind_of_difference_is_listed_with_vllms_and_kvpools_side():
    k = (PAGE.replace('le="2.5"', 'le="5.0"')  # another bucket bound
         .replace('finished_reason="abort"', 'finished_reason="cancelled"')  # another kind
         .replace("# TYPE vllm:num_requests_waiting_by_reason gauge", "# TYPE vllm:num_requests_waiting_by_reason counter")
         .replace('block_size="32",', ""))  # an info label gone
    k += "# TYPE vllm:kvpool_extra gauge\nvllm:kvpool_extra 1.0\n"
    v = PAGE + "# TYPE vllm:mm_cache_hits_total counter\nvllm:mm_cache_hits_total 0.0\n"
    got = {(d.family, d.what): (d.vllm, d.kvpool, d.reason) for d in diff(families(v), families(k), REASONS)}
    assert got == {
        ("vllm:cache_config_info", "labels"): ("block_size, engine, num_gpu_blocks", "engine, num_gpu_blocks", None),
        ("vllm:e2e_request_latency_seconds", "buckets"): ("0.3, 2.5, inf", "0.3, 5, inf", None),
        ("vllm:kvpool_extra", "kvpool only"): ("-", "gauge", None),
        ("vllm:mm_cache_hits", "vLLM only"): ("counter", "-", REASONS["vllm:mm_cache_hits"]),
        ("vllm:num_requests_waiting_by_reason", "type"): ("gauge", "counter", None),
        # NOTE: prometheus_client's parser names a counter's samples _total, as Prometheus does.
        ("vllm:num_requests_waiting_by_reason", "samples"): ('""', "_total", None),
        ("vllm:request_success", "values of finished_reason"): ("abort, length, stop", "cancelled, length, stop", None),
    }


def test_the_row_fails_on_a_difference_not_listed_and_passes_on_listed_ones():
    listed = PAGE + "# TYPE vllm:mm_cache_hits_total counter\nvllm:mm_cache_hits_total 0.0\n"
    doc = report(listed, PAGE, REASONS)
    row = metrics_row(doc)
    assert (doc["num_listed"], doc["num_unlisted"], row["met"]) == (1, 0, True)
    assert row["figure"] == "vllm:* families equal except 1 listed" and (row["vllm"], row["kvpool"]) == (5, 4)
    unlisted = listed + "# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_count 0.0\n"
    rows, doc = metrics_report({"main": {"vllm": unlisted, "kvpool": PAGE}}, REASONS)
    assert doc["pool"] == "main" and doc["num_unlisted"] == 1 and doc["num_listed"] == 1
    assert rows[0]["met"] is False and rows[0]["figure"].endswith("1 listed, 1 NOT listed")
    text = format_differences(doc)
    assert "vllm:request_queue_time_seconds  vLLM only  NOT LISTED" in text
    assert f"vllm:mm_cache_hits               vLLM only  listed: {REASONS['vllm:mm_cache_hits']}" in text


def test_the_row_prints_in_make_compares_table():
    from bench.compare.report import format_table

    (row,) = metrics_report({"main": {"vllm": PAGE + "# TYPE vllm:x gauge\nvllm:x 1.0\n", "kvpool": PAGE}})[0]
    line = format_table([row]).splitlines()[2]
    assert line.split() == ["metrics", "vllm:*", "families", "equal", "except", "0", "listed,", "1", "NOT", "listed",
                            "5", "4", "-", "0", "unlisted", "NO"]


def test_no_row_until_both_engines_left_a_page():
    assert metrics_report({}) == ([], {})
    assert metrics_report({"main": {"vllm": PAGE}}) == ([], {})
    rows, doc = metrics_report({"main": {"vllm": PAGE}, "small": {"vllm": PAGE, "kvpool": PAGE}})
    assert doc["pool"] == "small" and rows[0]["met"] is True
    assert format_differences({}) == ""


def test_every_accepted_family_is_one_vllm_has():
    # A reason for a family vLLM 0.32 never exposes would excuse nothing.
    reference = families(REFERENCE.read_text())
    assert set(ACCEPTED) <= set(reference), sorted(set(ACCEPTED) - set(reference))


def test_the_cli_diffs_two_saved_pages(tmp_path):
    v, k, out = tmp_path / "v.txt", tmp_path / "k.txt", tmp_path / "d.json"
    v.write_text(PAGE + "# TYPE vllm:request_queue_time_seconds histogram\nvllm:request_queue_time_seconds_count 0.0\n")
    k.write_text(PAGE)
    r = subprocess.run([sys.executable, "-m", "bench.compare.metrics", "--vllm-file", str(v), "--kvpool-file", str(k), "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 1 and "vllm:request_queue_time_seconds  vLLM only  NOT LISTED" in r.stdout, r.stdout + r.stderr
    assert json.loads(out.read_text())["num_unlisted"] == 1
    k.write_text(v.read_text())
    r = subprocess.run([sys.executable, "-m", "bench.compare.metrics", "--vllm-file", str(v), "--kvpool-file", str(k)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "equal except 0 listed" in r.stdout
    r = subprocess.run([sys.executable, "-m", "bench.compare.metrics", "--vllm-file", str(tmp_path / "none"), "--kvpool-file", str(k)],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "none" in r.stderr and "Traceback" not in r.stderr


def reference_flags() -> list[str]:
    """The vllm serve flags of the reference page's header (its lines that start with a
    flag), --host left out."""
    flags = [w for line in REFERENCE.read_text().splitlines() if line.startswith("#     --") for w in line[1:].split()]
    host = flags.index("--host")
    return flags[:host] + flags[host + 2 :]


@pytest.mark.e2e
@pytest.mark.slow
def test_a_live_kvpool_serve_started_as_the_reference_has_its_families(tiny_checkpoint, tmp_path):
    flags = reference_flags()
    assert "--kv-cache-metrics" in flags and flags[flags.index("--block-size") + 1] == "32"
    with kvpool_serve(tiny_checkpoint, tmp_path, *flags) as served:
        for i in range(3):
            status, body = post(served, "/v1/completions", {"model": "tiny", "prompt": f"{PROMPT} {i}", "max_tokens": 8})
            assert status == 200, body
        status, body = post(served, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                                                              "max_tokens": 4})
        assert status == 200, body
        doc = report(REFERENCE.read_text(), get_metrics(served))
    unlisted = [d for d in doc["differences"] if d["reason"] is None]
    assert unlisted == [], format_differences(doc)
    # Every reason still excuses a difference: none outlives what kvpool fixed.
    assert set(ACCEPTED) <= {d["family"] for d in doc["differences"]}
    assert doc["num_kvpool_families"] == doc["num_vllm_families"] - sum(d["what"] == "vLLM only" for d in doc["differences"])
