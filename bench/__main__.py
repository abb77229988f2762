"""`make bench`: run every benchmark suite and print one table, target beside each figure.

Each suite is a module with ``rows() -> list[Row]``. ``python -m bench pool`` runs one.
"""

from __future__ import annotations

import importlib
import sys

from bench.table import print_table

SUITES = ["pool_bench", "scheduler_bench", "engine_bench", "liveness_bench", "worker_bench", "model_bench", "loadgen_bench", "frontend_bench", "router_bench", "offload_bench", "offload_store_bench", "tp_bench"]


def main() -> int:
    wanted = [a for a in sys.argv[1:]] or [s.removesuffix("_bench") for s in SUITES]
    rows = []
    for suite in SUITES:
        if suite.removesuffix("_bench") not in wanted:
            continue
        try:
            mod = importlib.import_module(f"bench.{suite}")
        except ModuleNotFoundError as e:
            print(f"(suite {suite} not available: {e})", file=sys.stderr)
            continue
        rows.extend(mod.rows())
    print_table(rows)
    return 0 if all(r.ok is not False for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
