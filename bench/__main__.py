"""`make bench`: run every benchmark suite and print one table, target beside each figure.

Each suite is a module with ``rows() -> list[Row]``. ``python -m bench pool`` runs one.
``python -m bench gpu [ARGS]`` is not a suite: it hands its arguments to ``bench.gpu``, the
one call that checks the CUDA path on a CUDA host.
A benchmark reports: the table marks each figure below its target, and the exit status
is 0 unless a suite crashed (1) or was named wrongly (2). Figures on a shared, noisy
machine are not verdicts; `docs/benchmarks.md` keeps the runs with their conditions.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

from bench.gpu.cli import main as gpu_main
from bench.table import Row, print_table

SUITES = ["pool_bench", "scheduler_bench", "engine_bench", "liveness_bench", "worker_bench", "sampler_bench", "gemm_bench", "model_bench", "loadgen_bench", "frontend_bench", "router_bench", "router_hit_rate_bench", "offload_bench", "offload_store_bench", "tp_bench", "fleet_bench", "retention_bench", "retention_live_bench", "capacity_bench"]
NAMES = [s.removesuffix("_bench") for s in SUITES]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench",
        description="Run kvpool's benchmark suites and print one table, the target beside each figure. "
        "Exits 0 when every suite ran (a figure below its target is marked NO in the table, not an error), "
        "1 when a suite crashed.",
    )
    p.add_argument("suites", nargs="*", metavar="SUITE", help=f"suites to run (default: all): {', '.join(NAMES)}")
    return p


def run_suites(names: list[str]) -> tuple[list[Row], list[str]]:
    """The rows of every suite named, in SUITES' order, and the suites that crashed."""
    rows: list[Row] = []
    crashed: list[str] = []
    for suite in SUITES:
        if suite.removesuffix("_bench") not in names:
            continue
        try:
            rows.extend(importlib.import_module(f"bench.{suite}").rows())
        except Exception:  # noqa: BLE001 - one crashed suite must not hide the others' figures
            traceback.print_exc()
            print(f"python -m bench: suite {suite.removesuffix('_bench')} crashed", file=sys.stderr)
            crashed.append(suite.removesuffix("_bench"))
    return rows, crashed


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["gpu"]:
        return gpu_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in NAMES]
    if unknown:
        parser.error(f"unknown suite {', '.join(map(repr, unknown))}; the suites are: {', '.join(NAMES)}")
    rows, crashed = run_suites(args.suites or NAMES)
    if rows:
        print_table(rows)
    misses = sum(r.ok is False for r in rows)
    targets = sum(r.ok is not None for r in rows)
    print(f"\n{targets - misses} of {targets} figures with a target met; {misses} marked NO"
          + (f"; crashed: {', '.join(crashed)}" if crashed else ""))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
