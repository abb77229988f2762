"""vLLM's flags that kvpool serve hands on: each lands in the right child's argv, under
the child's flag, with the value as vLLM reads it (1k, half...), and nowhere else."""

from __future__ import annotations

import json
import sys

import pytest

from frontend.config import config_from_args
from frontend.serve.child_argv import passed_flags
from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Child, Launcher
from scheduler.engine.args import config_from_args as scheduler_config

FRONTEND_FLAGS = [
    "--uvicorn-log-level", "debug", "--max-logprobs", "5", "--chat-template", "/t/chat.jinja", "--enable-prompt-tokens-details",
    "--api-key", "k1", "k2", "--allowed-origins", '["https://a.example"]', "--allowed-methods", '["GET"]',
    "--allowed-headers", '["X-A"]', "--allow-credentials", "--ssl-keyfile", "/k.pem", "--ssl-certfile", "/c.pem",
    "--ssl-ca-certs", "/ca.pem", "--ssl-cert-reqs", "2", "--disable-uvicorn-access-log", "--disable-fastapi-docs",
    "--root-path", "/llm", "--response-role", "bot", "--enable-server-load-tracking",
]
SCHEDULER_FLAGS = [
    "--scheduling-policy", "priority", "--long-prefill-token-threshold", "64", "--no-enable-chunked-prefill",
    "--disable-chunked-mm-input", "--kv-cache-metrics-sample", "0.5", "--long-prefill-token-threshold-adaptive",
]


def built(argv: list[str], model: str = "m") -> dict[str, list[str]]:
    la = Launcher(parse_serve(["serve", model, *argv]), log=lambda *a, **k: None)
    la.build()
    return {name: c.argv for name, c in la.children.items()}


def flag_groups(argv: list[str]) -> set[tuple[str, ...]]:
    """Each flag with the values after it: {("--api-key", "k1", "k2"), ("--allow-credentials",), ...}."""
    groups: list[list[str]] = []
    for arg in argv:
        if arg.startswith("--"):
            groups.append([arg])
        else:
            groups[-1].append(arg)
    return {tuple(g) for g in groups}


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_the_frontends_flags_reach_the_frontend_as_given_and_only_it():
    c = built(FRONTEND_FLAGS)
    assert flag_groups(c["frontend"][-len(FRONTEND_FLAGS) :]) == flag_groups(FRONTEND_FLAGS)
    for flag in ("--api-key", "--chat-template", "--root-path", "--uvicorn-log-level"):
        assert flag not in c["scheduler"] and flag not in c["worker"]


def test_the_schedulers_flags_reach_the_scheduler_as_given_and_only_it():
    c = built(SCHEDULER_FLAGS)
    assert flag_groups(c["scheduler"][-len(SCHEDULER_FLAGS) :]) == flag_groups(SCHEDULER_FLAGS)
    assert "--scheduling-policy" not in c["frontend"] and "--scheduling-policy" not in c["worker"]


def test_a_flag_given_off_where_off_is_the_childs_default_is_not_passed():
    # --no-allow-credentials is the frontend's default; --no-enable-chunked-prefill is not the scheduler's
    assert passed_flags(parse_serve(["serve", "m", "--no-allow-credentials"]), "frontend") == []
    assert passed_flags(parse_serve(["serve", "m", "--enable-chunked-prefill"]), "scheduler") == ["--enable-chunked-prefill"]


def test_nothing_is_passed_that_was_not_given():
    c = built([])
    for flag in ("--api-key", "--uvicorn-log-level", "--ssl-keyfile", "--log-level"):
        assert flag not in c["frontend"]
    for flag in ("--scheduling-policy", "--enable-chunked-prefill", "--no-enable-chunked-prefill", "--prefix-caching-hash-algo"):
        assert flag not in c["scheduler"]


def test_mapped_flags_reach_their_childs_own_flag():
    c = built(["--dtype", "half", "--kv-cache-memory-bytes", "2K", "--distributed-timeout-seconds", "45",
               "--prefix-caching-hash-algo", "xxhash", "--log-level", "WARNING", "--max-model-len", "1k",
               "--max-num-batched-tokens", "1K", "--device-memory-utilization", "0.7", "-dpn", "0"])
    s, w, f = c["scheduler"], c["worker"], c["frontend"]
    assert value(w, "--dtype") == "float16" and value(w, "--kv-cache-memory") == "2048"
    assert value(w, "--distributed-timeout") == "45" and value(w, "--gpu-memory-utilization") == "0.7"
    assert value(s, "--prefix-caching-hash-algo") == "xxhash" and "--data-parallel-rank" not in s
    assert value(s, "--log-level") == value(w, "--log-level") == value(f, "--log-level") == "WARNING"
    assert value(s, "--max-model-len") == value(w, "--max-model-len") == value(f, "--max-model-len") == "1000"
    assert value(s, "--max-num-batched-tokens") == value(w, "--max-num-batched-tokens") == "1024"


def test_the_worker_profiles_the_step_the_scheduler_schedules():
    # The worker's memory profile runs max_num_batched_tokens tokens and samples max_num_seqs rows.
    given = built(["--max-num-batched-tokens", "3K", "--max-num-seqs", "48"])
    for child in ("scheduler", "worker"):
        assert value(given[child], "--max-num-batched-tokens") == "3072" and value(given[child], "--max-num-seqs") == "48"
    default = built([])  # NOTE: the default is not written: both children's is the same table row's
    assert "--max-num-seqs" not in default["worker"] + default["scheduler"]
    assert scheduler_config(default["scheduler"][3:]).max_num_seqs == 256


def test_float_is_float32_and_max_model_len_auto_or_minus_1_is_the_models(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 1000}')
    for auto in ("auto", "-1"):
        c = built(["--dtype", "float", f"--max-model-len={auto}"], str(tmp_path))
        assert value(c["worker"], "--dtype") == "float32" and value(c["scheduler"], "--max-model-len") == "1000"


def test_the_served_model_name_reaches_the_scheduler_and_the_frontend():
    c = built(["--served-model-name", "my-model"])
    assert value(c["scheduler"], "--served-model-name") == value(c["frontend"], "--served-model-name") == "my-model"


def test_vllm_api_key_in_the_environment_reaches_a_child(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "secret-from-env")
    child = Child("probe", [sys.executable, "-c", "import os; print(os.environ.get('VLLM_API_KEY'))"], tmp_path / "probe.log")
    child.start()
    try:
        child.proc.wait(timeout=30)
    finally:
        if child.alive():
            child.proc.kill()
        child._log.close()
    assert (tmp_path / "probe.log").read_text().strip() == "secret-from-env"


def test_disable_sliding_window_caps_the_length_at_the_window_as_vllm(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "sliding_window": 512}))
    assert value(built([], str(tmp_path))["scheduler"], "--max-model-len") == "4096"  # served past the window, as vLLM
    assert value(built(["--disable-sliding-window"], str(tmp_path))["worker"], "--max-model-len") == "512"
    assert "--disable-sliding-window" in built(["--disable-sliding-window"], str(tmp_path))["worker"]  # every layer full attention
    assert value(built(["--disable-sliding-window", "--max-model-len", "256"], str(tmp_path))["worker"], "--max-model-len") == "256"
    with pytest.raises(SystemExit) as e:
        built(["--disable-sliding-window", "--max-model-len", "1000"], str(tmp_path))
    assert e.value.code == 2 and "--max-model-len 1000 is longer than the model's sliding window 512" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps({"max_position_embeddings": 8192, "sliding_window": 512, "use_sliding_window": False}))
    assert value(built(["--disable-sliding-window"], str(tmp_path))["worker"], "--max-model-len") == "4096"  # Qwen2's window, off


def test_enable_mfu_metrics_gives_the_scheduler_the_checkpoint_and_the_workers_dtype():
    c = built(["--enable-mfu-metrics", "--dtype", "half"], model="/ckpt")
    assert "--enable-mfu-metrics" in c["scheduler"] and "--enable-mfu-metrics" not in c["worker"]
    assert value(c["scheduler"], "--model").endswith("ckpt") and value(c["scheduler"], "--dtype") == "float16"
    assert value(c["worker"], "--dtype") == "float16"
    assert "--enable-mfu-metrics" not in built([])["scheduler"]


def test_unchunked_prefill_raises_the_default_token_budget_to_a_whole_prompt_as_vllm():
    # vLLM: max_num_batched_tokens defaults to 2048, to max(max_model_len, 2048) with chunked prefill off
    assert value(built(["--max-model-len", "4096"])["scheduler"], "--max-num-batched-tokens") == "2048"
    unchunked = built(["--max-model-len", "4096", "--no-enable-chunked-prefill"])
    assert value(unchunked["scheduler"], "--max-num-batched-tokens") == "4096"
    assert value(unchunked["worker"], "--max-num-batched-tokens") == "4096"
    assert value(built(["--max-model-len", "1024", "--no-enable-chunked-prefill"])["scheduler"], "--max-num-batched-tokens") == "2048"
    given = built(["--max-model-len", "4096", "--no-enable-chunked-prefill", "--max-num-batched-tokens", "5000"])
    assert value(given["scheduler"], "--max-num-batched-tokens") == "5000"


def test_the_worker_labels_its_metrics_with_the_served_model_name():
    c = built(["--served-model-name", "tiny"])
    assert value(c["worker"], "--served-model-name") == "tiny" and value(c["scheduler"], "--served-model-name") == "tiny"


QUEUE_FLAGS = ["--max-num-queued-reqs", "1k", "--max-num-queued-tokens", "2K"]
BUDGET_FLAGS = ["--watermark", "0.05", "--max-num-scheduled-tokens", "1k"]


def test_the_queue_limits_reach_the_frontend_and_the_budget_flags_the_scheduler():
    # vLLM enforces the queue limits in its API server; each child reads 1k, 2K as vLLM does
    c = built(QUEUE_FLAGS + BUDGET_FLAGS)
    assert flag_groups(QUEUE_FLAGS) <= flag_groups(c["frontend"][3:])  # past: python -m frontend
    assert flag_groups(BUDGET_FLAGS) <= flag_groups(c["scheduler"][3:])
    for flag in ("--max-num-queued-reqs", "--max-num-queued-tokens"):
        assert flag not in c["scheduler"] and flag not in c["worker"]
    for flag in ("--watermark", "--max-num-scheduled-tokens"):
        assert flag not in c["frontend"] and flag not in c["worker"]


def test_queue_and_budget_flags_not_given_are_not_passed():
    c = built([])
    assert not {"--max-num-queued-reqs", "--max-num-queued-tokens"} & set(c["frontend"])
    assert not {"--watermark", "--max-num-scheduled-tokens"} & set(c["scheduler"])


def test_each_child_reads_the_queue_and_budget_flags_as_vllm():
    c = built(QUEUE_FLAGS + BUDGET_FLAGS)
    front = config_from_args(c["frontend"][3:])  # past: python -m frontend
    assert (front.max_num_queued_reqs, front.max_num_queued_tokens) == (1000, 2048)
    sched = scheduler_config(c["scheduler"][3:])
    assert (sched.watermark, sched.max_num_scheduled_tokens) == (0.05, 1000)


def test_max_num_active_seqs_reaches_the_scheduler_alone_as_vllm_reads_it():
    c = built(["--max-num-seqs", "8", "--max-num-active-seqs", "3"])
    assert ("--max-num-active-seqs", "3") in flag_groups(c["scheduler"][3:])
    assert "--max-num-active-seqs" not in c["frontend"] and "--max-num-active-seqs" not in c["worker"]
    assert scheduler_config(c["scheduler"][3:]).max_num_active_seqs == 3


def test_prefix_match_unit_and_prefill_schedule_interval_reach_the_scheduler_alone():
    c = built(["--prefix-match-unit", "16", "--prefill-schedule-interval", "2"])
    assert {("--prefix-match-unit", "16"), ("--prefill-schedule-interval", "2")} <= flag_groups(c["scheduler"][3:])
    for flag in ("--prefix-match-unit", "--prefill-schedule-interval"):
        assert flag not in c["frontend"] and flag not in c["worker"]
    scheduler_config(c["scheduler"][3:])  # the scheduler takes them (block size 16, prefix caching on)


def test_enable_logging_iteration_details_reaches_the_scheduler_alone():
    c = built(["--enable-logging-iteration-details"])
    assert "--enable-logging-iteration-details" in c["scheduler"]
    assert "--enable-logging-iteration-details" not in c["frontend"] and "--enable-logging-iteration-details" not in c["worker"]
    assert scheduler_config(c["scheduler"][3:]).enable_logging_iteration_details is True
    assert "--enable-logging-iteration-details" not in built(["--no-enable-logging-iteration-details"])["scheduler"]


def test_custom_histogram_buckets_reach_the_scheduler_verbatim():
    text = '{"request_latency": [0.5, 5]}'
    c = built(["--custom-histogram-buckets", text])
    assert ("--custom-histogram-buckets", text) in flag_groups(c["scheduler"][3:])
    assert "--custom-histogram-buckets" not in c["frontend"] and "--custom-histogram-buckets" not in c["worker"]
    assert scheduler_config(c["scheduler"][3:]).custom_histogram_buckets == {"request_latency": (0.5, 5.0)}
