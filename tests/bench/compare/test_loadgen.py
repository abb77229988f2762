"""The speed rows' multi-turn workload (``bench.compare.speed --workload multiturn``): one run of
kvpool's load generator through a real ``kvpool serve``'s chat API, its summary read back
under ``vllm bench serve``'s names, which the speed table takes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from kvtest.serve import kvpool_serve

from bench.compare.workloads import Workload, multiturn_args, run_loadgen

ROOT = Path(__file__).resolve().parents[3]


def conversation(cid: str, turns: int) -> dict:
    conv = []
    for t in range(turns):
        conv += [{"from": "human", "value": f"{cid} question {t} " + "word " * 20}, {"from": "gpt", "value": f"{cid} reply {t}"}]
    return {"id": cid, "conversations": conv}


@pytest.mark.e2e
@pytest.mark.slow
def test_a_multiturn_run_reports_under_vllm_bench_names(tmp_path, tiny_checkpoint):
    data = tmp_path / "sg.json"
    data.write_text(json.dumps([conversation(c, 2) for c in "ab"]))
    w = Workload("multiturn-c2", "main", multiturn_args(data, 2, 2, 6, seed=3), client="loadgen")
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--kv-cache-memory", "32MiB", "--served-model-name", "tiny") as served:
        fig = run_loadgen(ROOT, served.base_url, tiny_checkpoint, "tiny", w, tmp_path / "out", timeout_s=180)
    # 2 users x 2 rounds, 6 tokens an answer (the load generator ignores EOS by default)
    assert (fig["completed"], fig["failed"], fig["total_output_tokens"]) == (4, 0, 24)
    assert fig["output_throughput"] == pytest.approx(24 / fig["duration"])
    assert 0 < fig["median_ttft_ms"] <= fig["p99_ttft_ms"] and fig["median_tpot_ms"] > 0
    summary = json.loads((tmp_path / "out" / "multiturn-c2.json").read_text())
    assert fig["median_ttft_ms"] == summary["ttft_ms"]["median"]
