"""`make compare` (bench/compare/): the goal logic, the table, the Mooncake slice and the
servers' command lines, always; and, marked ``compare`` (skipped without ``.venv-vllm``
and unless selected with ``-m compare``, so never in CI), one small real run of both
engines whose result JSON must carry every key the table is built from."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare import runs
from bench.compare.cli import build_parser, pool_configs
from bench.compare.report import FIGURES, agreement_row, format_table, rows
from bench.compare.servers import ServerConfig, num_gpu_blocks, server_command, vllm_env
from bench.compare.workloads import (
    BENCH_KEYS,
    Workload,
    agreement_prompts,
    combine_runs,
    mooncake_slice,
    prefix_args,
    repeated,
)

ROOT = Path(__file__).resolve().parents[3]


def fig(**kw) -> dict:
    return {key: 1.0 for key, _, _ in FIGURES} | kw


def by(table, workload, label):
    (row,) = [r for r in table if r["workload"] == workload and r["figure"] == label]
    return row


def test_goals_are_judged_on_the_workloads_the_issue_names():
    results = {
        "prefix-c8": {"vllm": fig(output_throughput=100.0, median_ttft_ms=50.0, **{"vllm:prefix_cache_hits": 96.0}),
                      "kvpool": fig(output_throughput=120.0, median_ttft_ms=60.0, **{"vllm:prefix_cache_hits": 95.0})},
        "small-pool": {"vllm": fig(**{"vllm:num_preemptions": 20.0}), "kvpool": fig(**{"vllm:num_preemptions": 23.0})},
    }
    t = rows(results, {"prefix-c8": True, "small-pool": False})
    assert by(t, "prefix-c8", "output tok/s")["met"] is True
    assert by(t, "prefix-c8", "output tok/s")["ratio"] == pytest.approx(1.2)
    assert by(t, "prefix-c8", "TTFT p50 ms")["met"] is False
    assert by(t, "prefix-c8", "prefix-cache hits")["met"] is False  # exact equality, not close
    assert by(t, "prefix-c8", "prefix-cache queries")["met"] is True
    assert by(t, "small-pool", "preemptions")["met"] is False  # 15% off
    assert by(t, "small-pool", "output tok/s")["goal"] == ""  # no speed goal with a starved pool
    assert by(t, "small-pool", "prefix-cache hits")["met"] is None  # not a shared-prefix workload


def test_preemptions_within_ten_percent_and_a_missing_engine_judges_nothing():
    t = rows({"small-pool": {"vllm": fig(**{"vllm:num_preemptions": 20.0}), "kvpool": fig(**{"vllm:num_preemptions": 22.0})},
              "prefix-c64": {"vllm": fig()}}, {"prefix-c64": True})
    assert by(t, "small-pool", "preemptions")["met"] is True
    assert all(r["met"] is None and r["kvpool"] is None for r in t if r["workload"] == "prefix-c64")


def test_agreement_row_and_table_text():
    row = agreement_row({"fraction_identical": 0.9375, "dtype": "float32"})
    assert row["met"] is False and row["goal"] == ">= 95%"
    text = format_table(rows({"prefix-c8": {"vllm": fig(), "kvpool": fig()}}, {"prefix-c8": True}) + [row])
    lines = text.splitlines()
    assert lines[0].split()[:4] == ["workload", "figure", "vLLM", "kvpool"]
    assert len(lines) == 2 + len(FIGURES) + 1
    assert "greedy identical (float32)" in text and "NO" in lines[-1]


def test_repeated_runs_move_only_the_seed():
    w = Workload("prefix-c8", "main", prefix_args(64, 8, 64, seed=1))
    assert repeated(w, 0) is w
    again = repeated(w, 2)
    i = list(w.args).index("--seed")
    assert again.args[i + 1] == "2001" and again.args[:i + 1] == w.args[:i + 1] and again.args[i + 2:] == w.args[i + 2:]
    with pytest.raises(ValueError, match="no --seed"):
        repeated(Workload("x", "main", ("--num-prompts", "4")), 1)


def test_combined_runs_take_medians_sum_counters_and_the_highest_peak():
    def run(rate, ttft, hits, peak):
        return {k: 1.0 for k in BENCH_KEYS} | {"output_throughput": rate, "median_ttft_ms": ttft,
                                               "vllm:prefix_cache_hits": hits, "peak_kv_cache_usage_perc": peak}
    runs = [run(500.0, 90.0, 10, 0.2), run(700.0, 40.0, 12, 0.5), run(600.0, 70.0, 11, 0.3)]
    got = combine_runs(runs, ("vllm:prefix_cache_hits",))
    assert got["output_throughput"] == 600.0 and got["median_ttft_ms"] == 70.0
    assert got["vllm:prefix_cache_hits"] == 33 and got["peak_kv_cache_usage_perc"] == 0.5
    runs[1]["p99_ttft_ms"] = None  # a figure one run lacks is not made up from the others
    assert combine_runs(runs, ())["p99_ttft_ms"] is None


def test_mooncake_slice_scales_lengths_and_drops_what_does_not_fit(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in [
        {"timestamp": 0, "input_length": 1024, "output_length": 100, "hash_ids": [0, 1]},
        {"timestamp": 5, "input_length": 99999, "output_length": 10, "hash_ids": list(range(196))},
        {"timestamp": 9, "input_length": 600, "output_length": 2000, "hash_ids": [0, 2]},
    ]))
    out = mooncake_slice(trace, tmp_path / "s.jsonl", 10, scale=16, max_model_len=2048, max_output=64)
    got = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["timestamp"] for r in got] == [0, 9]
    assert got[0] == {"timestamp": 0, "input_length": 64, "output_length": 6, "hash_ids": [0, 1]}
    assert got[1]["input_length"] == 37 and got[1]["output_length"] == 64
    with pytest.raises(ValueError, match="no request fits"):
        mooncake_slice(trace, tmp_path / "x.jsonl", 10, scale=1, max_model_len=100, max_output=64)


def tiny_config_dir(tmp_path: Path) -> Path:
    """A checkpoint folder with only the tiny model's shape in config.json."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2,
                                                    "num_hidden_layers": 4, "head_dim": 32}))
    return model


def test_both_servers_get_the_same_settings(tmp_path):
    model = tiny_config_dir(tmp_path)
    cfg = ServerConfig(num_blocks=64, dtype="float32")
    v = server_command("vllm", model, 9000, cfg, ROOT, "tiny")
    k = server_command("kvpool", model, 9000, cfg, ROOT, "tiny")
    assert v[1] == k[1] == "serve"
    common = cfg.common_flags()
    assert v[2 : 2 + 7 + len(common)] == k[2 : 2 + 7 + len(common)]
    # The metrics row needs vLLM's kv_block_* families on both pages, sampled alike.
    assert common[common.index("--kv-cache-metrics") + 1 :][:2] == ["--kv-cache-metrics-sample", "0.01"]
    assert "--kv-cache-metrics" not in ServerConfig(kv_cache_metrics=False).common_flags()
    # 2 (K, V) x 4 layers x 2 heads x 32 dims x 32 tokens x 4 bytes, for all 64 blocks
    assert k[k.index("--kv-cache-memory") + 1] == str(64 * 65536)
    with pytest.raises(ValueError, match="unknown engine"):
        server_command("sglang", model, 9000, cfg, ROOT, "tiny")


def test_an_fp8_comparison_sizes_both_pools_from_the_same_kv_space(tmp_path):
    model = tiny_config_dir(tmp_path)
    cfg = ServerConfig(kv_cache_dtype="fp8", kv_space_gib=1)
    v = server_command("vllm", model, 9000, cfg, ROOT, "tiny")
    k = server_command("kvpool", model, 9000, cfg, ROOT, "tiny")
    for cmd in (v, k):
        assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8" and "--num-gpu-blocks-override" not in cmd
    assert k[k.index("--kv-cache-memory") + 1] == str(2**30)
    assert vllm_env(tmp_path, cfg, model, 1)["VLLM_CPU_KVCACHE_SPACE"] == "1"
    # 2 (K, V) x 4 layers x 2 heads x 32 dims x 32 tokens x 1 byte
    assert cfg.bytes_per_block(model) == 16384
    page = 'vllm:cache_config_info{block_size="32",cache_dtype="fp8",engine="0",num_gpu_blocks="65536"} 1.0\n'
    assert num_gpu_blocks(page) == 65536 and num_gpu_blocks("") is None


def test_vllm_binds_as_many_cores_as_kvpool_gets_threads(tmp_path):
    model = tiny_config_dir(tmp_path)
    cores = sorted(os.sched_getaffinity(0))
    for n in {1, len(cores)}:
        bind = vllm_env(tmp_path, ServerConfig(), model, n)["VLLM_CPU_OMP_THREADS_BIND"]
        assert [int(c) for c in bind.split(",")] == cores[:n]


@pytest.mark.parametrize("threads", ["0", str(len(os.sched_getaffinity(0)) + 1)])
def test_threads_outside_the_cores_are_refused(threads):
    r = subprocess.run([sys.executable, "-m", "bench.compare", "--threads", threads], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and f"--threads {threads}" in r.stderr


def test_agreement_prompts_share_prefixes_and_avoid_special_tokens():
    p = agreement_prompts(8, vocab=512)
    assert len(p) == 8 and all(len(x) == 80 for x in p)
    assert p[0][:64] == p[4][:64] != p[1][:64]
    assert min(min(x) for x in p) >= 5 and max(max(x) for x in p) < 512


def test_bad_block_size_is_refused_with_the_reason():
    r = subprocess.run([sys.executable, "-m", "bench.compare", "--block-size", "16"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "multiple of 32" in r.stderr


@pytest.mark.compare
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1800)
def test_a_small_real_compare_writes_every_key(real_vllm, tmp_path):
    out = tmp_path / "cmp"
    r = subprocess.run([sys.executable, "-m", "bench.compare", "--workloads", "prefix-c8", "--num-prompts", "8", "--repeat", "2",
                        "--agreement-prompts", "4", "--agreement-tokens", "8", "--trace", "", "--out", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=1700)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    doc = json.loads((out / "compare.json").read_text())
    assert {"settings", "workloads", "results", "agreement", "metrics", "table", "machine", "errors"} <= doc.keys()
    assert doc["errors"] == {}
    # Both pages compared after the same workload: one row, every difference with its side.
    (row,) = [r for r in doc["table"] if r["workload"] == "metrics"]
    assert row["vllm"] == doc["metrics"]["num_vllm_families"] > 0 and row["met"] == (doc["metrics"]["num_unlisted"] == 0)
    assert len(doc["metrics"]["differences"]) == doc["metrics"]["num_listed"] + doc["metrics"]["num_unlisted"]
    assert "vllm:* families equal except" in r.stdout
    for engine in ("vllm", "kvpool"):
        assert {key for key, _, _ in FIGURES} <= doc["results"]["prefix-c8"][engine].keys()
    assert {"fraction_identical", "num_requests", "num_identical", "num_failed", "dtype"} <= doc["agreement"].keys()
    assert {"workload", "figure", "vllm", "kvpool", "ratio", "goal", "met"} <= doc["table"][0].keys()
    assert doc["results"]["prefix-c8"]["vllm"]["completed"] == doc["results"]["prefix-c8"]["kvpool"]["completed"] == 8
    # Two runs each, new prompts each time: the counters add up over both.
    for engine in ("vllm", "kvpool"):
        runs = doc["results"]["prefix-c8"][engine]["runs"]
        assert len(runs) == 2 and sum(r["vllm:prompt_tokens"] for r in runs) == doc["results"]["prefix-c8"][engine]["vllm:prompt_tokens"]
    assert (out / "compare.png").stat().st_size > 0


def test_with_the_bfloat16_default_agreement_runs_on_a_float32_server(monkeypatch, tmp_path):
    a = build_parser().parse_args(["--out", str(tmp_path)])
    assert a.dtype == "bfloat16"
    a.engines, a.window, a.num_kv_groups, a.num_blocks = ["vllm", "kvpool"], 0, 1, 256
    pools = pool_configs(a)
    started = []

    def run_pool(engine, model, cfg, workloads, a, tag, results, prompts=None):
        started.append((engine, tag, cfg.dtype, [w.name for w in workloads], prompts is not None))
        return [[7]] * len(prompts) if prompts else None

    monkeypatch.setattr(runs, "run_pool", run_pool)
    ws = [Workload("prefix-c8", "main", prefix_args(8, 8, 64, seed=1), shared_prefix=True)]
    _, agree, errors = runs.run_all(tmp_path, pools, ws, 512, [[5, 6]] * 4, a)
    assert started == [("vllm", "main", "bfloat16", ["prefix-c8"], False), ("kvpool", "main", "bfloat16", ["prefix-c8"], False),
                       ("vllm", "float32", "float32", [], True), ("kvpool", "float32", "float32", [], True)]
    assert errors == {} and agree["dtype"] == "float32" and agree["fraction_identical"] == 1.0
