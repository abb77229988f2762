"""Load-generator benchmarks: rebuilding Mooncake prompts from their block hash ids.

`expand_hash_ids` turns each 512-token block id into its tokens with a vectorised
integer hash; the offline simulator expands whole traces with it (the conversation
trace is ~149M tokens), so a per-token Python loop would show here at once.

``python -m bench loadgen`` prints the table.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.table import Row
from loadgen.datasets import expand_hash_ids, load_mooncake_trace

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
NUM_RECORDS = 2000
EXPAND_TARGET_MTOK_S = 20.0


def expand_mtok_per_s(repeat: int = 3) -> tuple[float, int]:
    """Best-of-``repeat`` million tokens per second expanding the trace's first
    NUM_RECORDS prompts, and how many tokens that is."""
    records = load_mooncake_trace(TRACE)[:NUM_RECORDS]
    best, total = float("inf"), 0
    for _ in range(repeat):
        t0 = time.perf_counter()
        total = sum(len(expand_hash_ids(r.hash_ids, r.input_length)) for r in records)
        best = min(best, time.perf_counter() - t0)
    return total / best / 1e6, total


def rows() -> list[Row]:
    if not TRACE.exists():
        return [Row(f"mooncake expand (no trace at {TRACE})", float("nan"), "")]
    rate, total = expand_mtok_per_s()
    return [Row(f"mooncake expand_hash_ids, {NUM_RECORDS} prompts ({total / 1e6:.0f}M tok)", rate, "Mtok/s",
                f"≥ {EXPAND_TARGET_MTOK_S:g} Mtok/s", rate >= EXPAND_TARGET_MTOK_S)]


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
