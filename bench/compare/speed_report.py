"""The speed matrix's table (``python -m bench.compare.speed``): one row per cell
(checkpoint, dtype, sampling, concurrency), each engine's median output tok/s, TPOT p50
and TTFT p50 over its runs, the ratios kvpool / vLLM, the prefix-cache counters summed
over the runs, the load average's range over every run of the cell, and the goal.

The goal of a cell (issue #25): output tok/s ratio >= 1.0, TPOT p50 ratio <= 1.1, kvpool's
TTFT p50 <= vLLM's, prefix-cache queries and hits equal, and no request failed on either
engine (a cell where one did compares different work).
"""

from __future__ import annotations

import statistics

from bench.compare.report import align, fmt_number

QUERIES, HITS = "vllm:prefix_cache_queries", "vllm:prefix_cache_hits"
MEDIANS = ("output_throughput", "median_tpot_ms", "median_ttft_ms")
MIN_TOKS_RATIO = 1.0
MAX_TPOT_RATIO = 1.1


def summarize(runs: list[dict]) -> dict:
    """One engine's runs of a cell: the median of each MEDIANS figure, the counters and
    failed requests summed (the same prompts on both engines: equal sums), the load
    average's range."""
    out = {k: statistics.median(r[k] for r in runs) for k in MEDIANS}
    out |= {c: sum(r[c] for r in runs) for c in (QUERIES, HITS)}
    out["failed"] = sum(r.get("failed") or 0 for r in runs)
    loads = [x for r in runs for x in (r["load_before"], r["load_after"])]
    return out | {"load_min": min(loads), "load_max": max(loads), "num_runs": len(runs)}


def judge(v: dict, k: dict) -> dict:
    """Each part of the goal on the two summaries, and ``met``: all of them."""
    toks = k["output_throughput"] / v["output_throughput"] if v["output_throughput"] else None
    tpot = k["median_tpot_ms"] / v["median_tpot_ms"] if v["median_tpot_ms"] else None
    parts = {"tok/s": toks is not None and toks >= MIN_TOKS_RATIO,
             "TPOT": tpot is not None and tpot <= MAX_TPOT_RATIO,
             "TTFT": k["median_ttft_ms"] <= v["median_ttft_ms"],
             "queries": k[QUERIES] == v[QUERIES], "hits": k[HITS] == v[HITS],
             "failed": k["failed"] == 0 and v["failed"] == 0}
    return {"toks_ratio": toks, "tpot_ratio": tpot, "parts": parts, "met": all(parts.values())}


def cell_row(cell: dict, runs: dict[str, list[dict]]) -> dict:
    """The table's row of one cell from each engine's runs (an engine without runs: its
    figures None and no judgement)."""
    s = {e: summarize(r) for e, r in runs.items() if r}
    v, k = s.get("vllm"), s.get("kvpool")
    g = judge(v, k) if v and k else dict.fromkeys(("toks_ratio", "tpot_ratio", "parts", "met"))
    return cell | {"vllm": v, "kvpool": k, **g,
                   "load_min": min((x["load_min"] for x in s.values()), default=None),
                   "load_max": max((x["load_max"] for x in s.values()), default=None)}


def _pair(row: dict, key: str) -> tuple[str, str]:
    return tuple(fmt_number(row[e][key]) if row[e] else "-" for e in ("vllm", "kvpool"))


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def format_matrix(table: list[dict]) -> str:
    head = ("checkpoint", "dtype", "sampling", "conc", "vLLM tok/s", "kvpool tok/s", "ratio", "vLLM TPOT", "kvpool TPOT",
            "ratio", "vLLM TTFT", "kvpool TTFT", "queries v/k", "hits v/k", "load", "met")
    body = []
    for r in table:
        q, h = _pair(r, QUERIES), _pair(r, HITS)
        load = "-" if r["load_min"] is None else f"{r['load_min']:.1f}-{r['load_max']:.1f}"
        met = "" if r["met"] is None else "yes" if r["met"] else "NO: " + ",".join(p for p, ok in r["parts"].items() if not ok)
        body.append((r["checkpoint"], r["dtype"], r["sampling"], str(r["concurrency"]), *_pair(r, "output_throughput"),
                     _ratio(r["toks_ratio"]), *_pair(r, "median_tpot_ms"), _ratio(r["tpot_ratio"]),
                     *_pair(r, "median_ttft_ms"), "/".join(q), "/".join(h), load, met))
    goal = (f"goal: tok/s ratio >= {MIN_TOKS_RATIO}, TPOT p50 ratio <= {MAX_TPOT_RATIO}, TTFT p50 kvpool <= vLLM, queries and hits "
            "equal, no request failed (NO: failed)")
    return align(head, body, num_left=3) + "\n" + goal
