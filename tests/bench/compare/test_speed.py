"""`make compare-speed` (bench/compare/speed.py, speed_report.py): the alternating run order, each cell's
own prompts, a cell's goal, the table from canned runs, the flag errors, and the
temperature flag of vllm bench serve's command line. No real run here: both servers'
start-up is too slow for the suite (``make compare-speed`` runs it)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from bench.compare.speed import cells, schedule
from bench.compare.speed_report import HITS, QUERIES, cell_row, format_matrix, judge, summarize
from bench.compare.workloads import (
    Workload,
    bench_command,
    multiturn_args,
    prefix_args,
    sharegpt_args,
)

ROOT = Path(__file__).resolve().parents[3]


def run(toks, tpot, ttft, queries=100.0, hits=60.0, load=(1.0, 1.5), failed=0) -> dict:
    return {"output_throughput": toks, "median_tpot_ms": tpot, "median_ttft_ms": ttft, QUERIES: queries, HITS: hits,
            "load_before": load[0], "load_after": load[1], "failed": failed}


def test_engines_alternate_and_swap_who_goes_first_on_odd_repeats():
    order = schedule(2, ["vllm", "kvpool"], 3)
    assert order == [
        (0, 0, "vllm"), (0, 0, "kvpool"), (0, 1, "vllm"), (0, 1, "kvpool"),
        (1, 0, "kvpool"), (1, 0, "vllm"), (1, 1, "kvpool"), (1, 1, "vllm"),
        (2, 0, "vllm"), (2, 0, "kvpool"), (2, 1, "vllm"), (2, 1, "kvpool"),
    ]
    assert schedule(2, ["kvpool"], 2) == [(0, 0, "kvpool"), (0, 1, "kvpool"), (1, 0, "kvpool"), (1, 1, "kvpool")]


def test_cells_take_the_prefix_workloads_shape_with_prompts_of_their_own():
    got = cells(["greedy", "default"], [8, 64])
    assert [(s, c) for s, c, _ in got] == [("greedy", 8), ("greedy", 64), ("default", 8), ("default", 64)]
    # prefix-c8: 64 prompts; prefix-c64: 128 (bench.compare.workloads.default_workloads)
    assert got[0][2].args == prefix_args(64, 8, 64, seed=1)
    assert got[1][2].args == prefix_args(128, 64, 64, seed=2)
    seeds = [w.args[list(w.args).index("--seed") + 1] for _, _, w in got]
    assert len(set(seeds)) == 4  # no cell hits another's prefixes on the same server


def test_sharegpt_cells_take_48_prompts_at_c8_and_three_per_user_above():
    path = Path("/data/sg.json")
    got = cells(["default"], [8, 32], "sharegpt", path)
    assert [w.args for _, _, w in got] == [sharegpt_args(path, 48, 8, seed=1), sharegpt_args(path, 96, 32, seed=2)]
    args = list(got[1][2].args)
    assert args[args.index("--dataset-name") + 1] == "sharegpt" and args[args.index("--dataset-path") + 1] == str(path)
    assert "--ignore-eos" in args and all(w.client == "vllm" for _, _, w in got)


def test_multiturn_cells_run_kvpools_load_generator_one_user_per_concurrent_request():
    path = Path("/data/sg.json")
    (_, c, w), = cells(["greedy"], [8], "multiturn", path)
    assert w.client == "loadgen" and w.args == multiturn_args(path, 8, 4, 64, seed=1)
    args = list(w.args)
    assert [args[args.index(f) + 1] for f in ("--dataset", "--num-users", "--num-rounds", "--output-len")] == ["multiturn", "8", "4", "64"]


def test_summaries_take_medians_sum_counters_and_keep_the_load_range():
    s = summarize([run(100.0, 10.0, 50.0, load=(0.5, 1.0)), run(300.0, 30.0, 70.0, load=(2.0, 1.2)),
                   run(200.0, 20.0, 90.0, load=(0.9, 0.8))])
    assert (s["output_throughput"], s["median_tpot_ms"], s["median_ttft_ms"]) == (200.0, 20.0, 70.0)
    assert (s[QUERIES], s[HITS], s["load_min"], s["load_max"], s["num_runs"]) == (300.0, 180.0, 0.5, 2.0, 3)
    assert summarize([run(1.0, 1.0, 1.0, failed=45), run(1.0, 1.0, 1.0), run(1.0, 1.0, 1.0, failed=2)])["failed"] == 47


def test_a_request_the_reference_failed_fails_the_cell_too():
    """vLLM's server dropped 45 of 128 requests in one run (its engine died): the two
    engines did different work, so the cell is not met whoever was faster."""
    g = judge(summarize([run(100.0, 10.0, 50.0, failed=45)]), summarize([run(300.0, 5.0, 20.0)]))
    assert [p for p, ok in g["parts"].items() if not ok] == ["failed"] and g["met"] is False


@pytest.mark.parametrize("kvpool, failing", [
    (run(100.0, 11.0, 50.0), []),  # equal speed, TPOT 10% slower, same TTFT: met
    (run(99.0, 10.0, 40.0), ["tok/s"]),
    (run(120.0, 11.2, 40.0), ["TPOT"]),
    (run(120.0, 9.0, 50.5), ["TTFT"]),
    (run(120.0, 9.0, 40.0, queries=101.0), ["queries"]),
    (run(120.0, 9.0, 40.0, hits=59.0), ["hits"]),
    (run(120.0, 9.0, 40.0, failed=3), ["failed"]),
])
def test_a_cell_meets_the_goal_only_with_every_part(kvpool, failing):
    g = judge(summarize([run(100.0, 10.0, 50.0)]), summarize([kvpool]))
    assert [p for p, ok in g["parts"].items() if not ok] == failing
    assert g["met"] is (not failing)
    assert g["toks_ratio"] == pytest.approx(kvpool["output_throughput"] / 100.0)
    assert g["tpot_ratio"] == pytest.approx(kvpool["median_tpot_ms"] / 10.0)


def test_table_rows_from_canned_runs():
    cell = {"checkpoint": "llama50m", "dtype": "bfloat16", "sampling": "default", "concurrency": 8}
    row = cell_row(cell, {"vllm": [run(100.0, 10.0, 50.0, load=(1.0, 2.0)), run(120.0, 12.0, 70.0, load=(1.5, 1.5))],
                          "kvpool": [run(150.0, 8.0, 40.0, load=(0.7, 1.1)), run(130.0, 9.0, 45.0, load=(1.2, 1.3))]})
    assert row["toks_ratio"] == pytest.approx(140.0 / 110.0) and row["tpot_ratio"] == pytest.approx(8.5 / 11.0)
    assert (row["load_min"], row["load_max"], row["met"]) == (0.7, 2.0, True)
    alone = cell_row(cell | {"concurrency": 64}, {"vllm": [], "kvpool": [run(150.0, 8.0, 40.0)]})
    assert alone["vllm"] is None and alone["met"] is None and alone["toks_ratio"] is None
    lines = format_matrix([row, alone]).splitlines()
    assert lines[0].split()[:6] == ["checkpoint", "dtype", "sampling", "conc", "vLLM", "tok/s"]
    cols = lines[2].split()
    assert cols[:8] == ["llama50m", "bfloat16", "default", "8", "110", "140", "1.273", "11"]
    assert cols[-3:] == ["120/120", "0.7-2.0", "yes"]
    assert lines[3].split()[4] == "-" and lines[-1].startswith("goal: tok/s ratio >= 1.0")
    miss = cell_row(cell, {"vllm": [run(100.0, 10.0, 50.0)], "kvpool": [run(90.0, 12.0, 40.0)]})
    assert format_matrix([miss]).splitlines()[2].endswith("NO: tok/s,TPOT")


@pytest.mark.parametrize("temperature, sent", [(0.0, "0"), (0.7, "0.7"), (None, None)])
def test_bench_sends_the_temperature_asked_or_none(tmp_path, temperature, sent):
    w = Workload("c8", "main", prefix_args(64, 8, 64, seed=1))
    cmd = bench_command(ROOT, "http://127.0.0.1:9", tmp_path, "tiny", w, tmp_path / "r.json", temperature)
    if sent is None:
        assert "--temperature" not in cmd
    else:
        assert cmd[cmd.index("--temperature") + 1] == sent and cmd.count("--temperature") == 1
    assert cmd[cmd.index("--result-dir") + 1] == str(tmp_path) and cmd[cmd.index("--result-filename") + 1] == "r.json"
    assert cmd[cmd.index("--dataset-name") :][: len(w.args)] == list(w.args)


@pytest.mark.parametrize("flags, message", [
    (["--checkpoints", "tiny,gemma3"], "--checkpoints 'tiny,gemma3': 'gemma3' not one of tiny, llama50m, smollm2"),
    (["--workload", "multiturn"], "--workload multiturn: its chat client sends temperature 0; give --sampling greedy"),
    (["--dtypes", "float16"], "--dtypes 'float16': 'float16' not one of bfloat16, float32"),
    (["--sampling", "greedy,greedy"], "--sampling 'greedy,greedy': empty or repeated values"),
    (["--engines", "sglang"], "--engines 'sglang'"),
    (["--concurrency", "8,x"], "--concurrency '8,x': comma-separated whole numbers"),
    (["--concurrency", "0"], "--concurrency [0]: each at least 1"),
    (["--repeat", "0"], "--repeat 0: at least one run"),
    (["--threads", "0"], "--threads 0: this process may use"),
])
def test_bad_flags_are_refused_naming_the_flag(flags, message, tmp_path):
    r = subprocess.run([sys.executable, "-m", "bench.compare.speed", *flags, "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and message in r.stderr, r.stderr
