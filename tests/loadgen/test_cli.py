"""`python -m loadgen` end to end, as a subprocess, against the fake scheduler and /metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest.ports import free_port

from loadgen.datasets import shared_prefix_requests

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e


def _loadgen(*args: str, bound: float = 60) -> subprocess.CompletedProcess:
    proc = subprocess.Popen(
        [sys.executable, "-m", "loadgen", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = proc.communicate(timeout=bound)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=10)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def test_end_to_end_result_json_and_outputs(
    tmp_path, fake_scheduler_factory, fake_metrics, expected_tokens
):
    sched = fake_scheduler_factory()
    result = tmp_path / "result.json"
    plot = tmp_path / "plot.png"
    args = [
        "--num-requests",
        "12",
        "--num-prefixes",
        "3",
        "--prefix-len",
        "32",
        "--suffix-len",
        "8",
    ]
    args += ["--output-len", "5", "--request-rate", "50", "--seed", "4", "--max-concurrency", "4"]
    p = _loadgen(
        "--scheduler",
        sched.address,
        "--metrics-url",
        fake_metrics.url,
        *args,
        "--metrics-interval",
        "0.05",
        "--result-json",
        str(result),
        "--save-outputs",
        "--plot",
        str(plot),
        "--timeout",
        "30",
    )
    assert p.returncode == 0, p.stderr
    assert "Serving Benchmark Result" in p.stdout and "Prefix cache hit rate:" in p.stdout
    data = json.loads(result.read_text())
    assert data["completed"] == 12 and data["failed"] == 0
    assert data["duration_s"] > 0 and data["request_throughput"] > 0
    assert data["output_throughput"] == pytest.approx(60 / data["duration_s"])
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        assert set(data[key]) == {"mean", "median", "p99"} and data[key]["mean"] > 0
    assert data["prefix_cache_hit_rate"] == pytest.approx(0.4)  # the fake's 40 hits / 100 queries
    assert data["num_preemptions"] >= 1
    assert 0 <= data["mean_kv_cache_usage"] <= data["peak_kv_cache_usage"] <= 1
    # outputs in dataset order, tokens as the fake generated them from each prompt
    reqs = shared_prefix_requests(12, 3, 32, 8, 5, seed=4)
    assert [o["index"] for o in data["outputs"]] == list(range(12))
    for o, req in zip(data["outputs"], reqs, strict=True):
        assert o["token_ids"] == expected_tokens(req.prompt_token_ids, 5)
    got = {m.request_id: m for m in sched.received}
    for o, req in zip(data["outputs"], reqs, strict=True):
        m = got[o["request_id"]]
        assert m.prompt_token_ids == req.prompt_token_ids and m.max_tokens == 5 and m.ignore_eos
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_failures_give_exit_1_and_are_counted(tmp_path, fake_scheduler_factory):
    sched = fake_scheduler_factory(lambda i: {0: "reject", 1: "silent"}.get(i, "ok"))
    result = tmp_path / "r.json"
    p = _loadgen(
        "--scheduler",
        sched.address,
        "--metrics-url",
        "",
        "--dataset",
        "random",
        "--num-requests",
        "4",
        "--input-len",
        "20",
        "--output-len",
        "3",
        "--respect-eos",
        "--request-timeout",
        "1",
        "--result-json",
        str(result),
    )
    assert p.returncode == 1, p.stderr
    assert "2 of 4 requests failed" in p.stderr
    data = json.loads(result.read_text())
    assert data["completed"] == 2 and data["failed"] == 2
    assert data["prefix_cache_hit_rate"] is None
    assert all(not m.ignore_eos for m in sched.received)


def test_unreachable_scheduler_exits_nonzero_quickly():
    port = free_port()
    # NOTE: the 60 s bound (not a timed assertion) catches a hang; the exit status and
    # the message show the 2 s connect timeout is what ended it.
    p = _loadgen(
        "--scheduler",
        f"tcp://127.0.0.1:{port}",
        "--connect-timeout",
        "2",
        "--num-requests",
        "3",
    )
    assert p.returncode == 3
    assert "cannot reach the scheduler" in p.stderr and str(port) in p.stderr and "within 2 s" in p.stderr


def test_mooncake_needs_trace():
    p = _loadgen("--dataset", "mooncake", bound=30)
    assert p.returncode == 2 and "--trace" in p.stderr


def test_an_empty_trace_is_an_error_not_a_run_of_nothing(tmp_path, fake_scheduler_factory):
    sched = fake_scheduler_factory()
    trace = tmp_path / "empty.jsonl"
    trace.write_text("\n")
    p = _loadgen("--scheduler", sched.address, "--metrics-url", "", "--trace", str(trace), bound=30)
    assert p.returncode == 2, p.stdout
    assert "has no requests" in p.stderr and str(trace) in p.stderr
    assert "Serving Benchmark Result" not in p.stdout and sched.received == []


def test_a_trace_with_another_dataset_is_refused_before_running(tmp_path, fake_scheduler_factory):
    sched = fake_scheduler_factory()
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n')
    p = _loadgen("--scheduler", sched.address, "--metrics-url", "", "--trace", str(trace), "--dataset", "random", bound=30)
    assert p.returncode == 2 and "--dataset mooncake" in p.stderr
    assert sched.received == []


def test_outputs_into_missing_folders_are_written_and_the_report_names_the_workload(tmp_path, fake_scheduler_factory):
    sched = fake_scheduler_factory()
    result, plot = tmp_path / "new" / "r.json", tmp_path / "other" / "deep" / "p.png"
    p = _loadgen("--scheduler", sched.address, "--metrics-url", "", "--num-requests", "3", "--prefix-len", "8",
                 "--suffix-len", "4", "--output-len", "2", "--result-json", str(result), "--plot", str(plot))
    assert p.returncode == 0, p.stderr
    assert json.loads(result.read_text())["completed"] == 3
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "Workload: shared-prefix: 3 requests (8 prefixes x 8 tokens + 4-token suffixes, 2 out), all at once" in p.stdout


def test_mooncake_replay(tmp_path, fake_scheduler_factory):
    sched = fake_scheduler_factory()
    trace = tmp_path / "trace.jsonl"
    trace.write_text(
        '{"timestamp": 1000, "input_length": 700, "output_length": 3, "hash_ids": [0, 1]}\n'
        '{"timestamp": 1500, "input_length": 600, "output_length": 2, "hash_ids": [0, 2]}\n'
    )
    result = tmp_path / "r.json"
    p = _loadgen(
        "--scheduler",
        sched.address,
        "--metrics-url",
        "",
        "--dataset",
        "mooncake",
        "--trace",
        str(trace),
        "--time-scale",
        "2",
        "--max-input-len",
        "650",
        "--result-json",
        str(result),
    )
    assert p.returncode == 0, p.stderr
    data = json.loads(result.read_text())
    assert data["completed"] == 2 and data["total_output_tokens"] == 5
    assert data["duration_s"] >= 1.0  # second request sent (1500-1000) ms * 2 after the first
    a, b = sorted(sched.received, key=lambda m: int(m.request_id.rsplit("-", 1)[1]))
    assert len(a.prompt_token_ids) == 650 and len(b.prompt_token_ids) == 600
    assert a.prompt_token_ids[:512] == b.prompt_token_ids[:512]
    assert a.prompt_token_ids[512:600] != b.prompt_token_ids[512:600]
