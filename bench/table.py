"""The benchmark table: one row per figure, the target beside it."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Row:
    """One measured figure. ``ok`` is None where the row has no target (context only)."""

    name: str
    value: float
    unit: str
    target: str = ""
    ok: bool | None = None


def best_per_op_us(fn: Callable[[], None], ops_per_call: int = 1, repeat: int = 7, min_time_s: float = 0.2) -> float:
    """Best-of-``repeat`` microseconds per operation; each repeat runs ``fn`` for at
    least ``min_time_s`` (the minimum is the figure least disturbed by a noisy machine)."""
    best = float("inf")
    for _ in range(repeat):
        n = 0
        t0 = time.perf_counter()
        while True:
            fn()
            n += 1
            elapsed = time.perf_counter() - t0
            if elapsed >= min_time_s:
                break
        best = min(best, elapsed / (n * ops_per_call))
    return best * 1e6


def print_table(rows: list[Row]) -> None:
    w = max(len(r.name) for r in rows)
    print(f"{'benchmark':<{w}}  {'measured':>14}  {'target':<16} ok")
    print("-" * (w + 40))
    for r in rows:
        mark = {True: "yes", False: "NO", None: ""}[r.ok]
        print(f"{r.name:<{w}}  {r.value:>10.3f} {r.unit:<3}  {r.target:<16} {mark}")
