"""The benchmark report, as `vllm bench serve` prints it, plus what /metrics saw.

`summarize` turns request results and metric samples into a flat dict (the
`--result-json` content); `format_report` prints it as a table. Latencies come from
successful requests only and are reported in ms as {"mean", "median", "p99"}
(np.percentile, linear interpolation). Empty inputs give None, never a made-up 0.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from loadgen.metrics_scraper import MetricsSample, delta
from loadgen.request_result import RequestResult

LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
# Distinct errors the report lists; the rest are counted in one line (all are in the JSON).
MAX_LISTED_ERRORS = 5
# Words of a refusal of a request too long for the server: the scheduler's
# (scheduler/sched/validation.py), and the OpenAI server's (vLLM's wording, also kvpool serve's).
TOO_LONG_WORDS = ("over max_model_len", "KV blocks but the whole pool", "maximum context length")
LATENCY_TITLES = {
    "ttft_ms": "Time to First Token",
    "tpot_ms": "Time per Output Token (excl. 1st token)",
    "itl_ms": "Inter-token Latency",
    "e2el_ms": "End-to-end Latency",
}


def latency_stats(values_s: Sequence[float]) -> dict[str, float | None]:
    """Mean, median and p99 of latencies given in seconds, in milliseconds."""
    if len(values_s) == 0:
        return {"mean": None, "median": None, "p99": None}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    return {
        "mean": float(ms.mean()),
        "median": float(np.median(ms)),
        "p99": float(np.percentile(ms, 99)),
    }


def _series_stats(series: Sequence[MetricsSample], name: str) -> tuple[float | None, float | None]:
    vals = [v for s in series if (v := getattr(s, name)) is not None]
    if not vals:
        return None, None
    return float(max(vals)), float(np.mean(vals))


def run_peak_usage(
    before: MetricsSample | None, after: MetricsSample | None, polled_peak: float | None
) -> tuple[float | None, bool | None]:
    """The run's peak KV usage, and whether it is exact.

    NOTE: polls between steps miss the peak (a step's frees come at its end), so a
    short run can poll 0 % beside many preemptions. The scheduler tracks its own peak
    since start (kvpool_peak_kv_cache_usage_perc): if it rose during the run, it is the
    run's peak. If not, an earlier run set it and the polled peak is all there is."""
    b = before.peak_kv_cache_usage if before is not None else None
    a = after.peak_kv_cache_usage if after is not None else None
    if a is None or b is None:
        return polled_peak, None
    if a > b or a == 0.0:
        return a, True
    return polled_peak, False


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    before: MetricsSample | None = None,
    after: MetricsSample | None = None,
    series: Sequence[MetricsSample] = (),
) -> dict:
    """The result dict; `series` should include the before/after samples."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    tpots = [(r.latency_s - r.ttft_s) / (r.output_len - 1) for r in ok if r.output_len > 1]
    d_queries = delta(before, after, "prefix_cache_queries")
    d_hits = delta(before, after, "prefix_cache_hits")
    d_pre = delta(before, after, "num_preemptions")
    polled_peak, mean_usage = _series_stats(series, "kv_cache_usage")
    peak_usage, peak_exact = run_peak_usage(before, after, polled_peak)
    cached = None if any(r.num_cached_tokens is None for r in ok) else sum(r.num_cached_tokens for r in ok)
    summary = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else None,
        "ttft_ms": latency_stats([r.ttft_s for r in ok if r.ttft_s is not None]),
        "tpot_ms": latency_stats(tpots),
        "itl_ms": latency_stats([x for r in ok for x in r.itl_s]),
        "e2el_ms": latency_stats([r.latency_s for r in ok if r.latency_s is not None]),
        "prefix_cache_hit_rate": d_hits / d_queries if d_queries and d_hits is not None else None,
        "num_preemptions": int(d_pre) if d_pre is not None else None,
        "peak_kv_cache_usage": peak_usage,
        # True: the scheduler's own peak (it rose during the run); False: the highest
        # polled value (the scheduler's peak is an earlier run's); None: no such gauge.
        "peak_kv_cache_usage_exact": peak_exact,
        "scheduler_peak_kv_cache_usage": after.peak_kv_cache_usage if after is not None else None,
        "mean_kv_cache_usage": mean_usage,
        # What the scheduler told each client about its own prompt (TokenOutput.num_cached_tokens).
        # None when the server did not report it (kvpool serve/vllm serve: --enable-prompt-tokens-details).
        "client_cached_token_frac": cached / in_tokens if in_tokens and cached is not None else None,
        # The pool the run met (kvpool_num_gpu_blocks, the null block included).
        "num_gpu_blocks": int(after.num_gpu_blocks) if after is not None and after.num_gpu_blocks is not None else None,
        "errors": _error_counts(results),
        "num_rejected_too_long": sum(
            1 for r in results if not r.success and r.error and any(w in r.error for w in TOO_LONG_WORDS)
        ),
    }
    return summary


def _error_counts(results: Sequence[RequestResult]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for r in results:
        if not r.success:
            key = r.error or "unknown"
            counts[key] = counts.get(key, 0) + 1
    return counts


def outputs_list(results: Sequence[RequestResult]) -> list[dict]:
    """`--save-outputs`: one entry per request, in dataset order."""
    return [
        {"index": r.index, "request_id": r.request_id, "token_ids": list(r.token_ids)}
        for r in sorted(results, key=lambda r: r.index)
    ]


def write_result_json(
    path: str | Path, summary: dict, results: Sequence[RequestResult] | None = None
) -> None:
    data = dict(summary)
    if results is not None:
        data["outputs"] = outputs_list(results)
    Path(path).write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def format_report(summary: dict, title: str = "Serving Benchmark Result") -> str:
    """A vllm-bench-style table."""
    w = 50
    lines = [f"{' ' + title + ' ':=^{w}}"]

    def row(label: str, value, spec: str = "") -> None:
        lines.append(f"{label:<40}{_fmt(value, spec):>10}")

    if summary.get("workload"):
        lines.append(f"Workload: {summary['workload']}")
    if "num_gpu_blocks" in summary:
        row("KV pool (blocks, /metrics):", summary["num_gpu_blocks"])

    row("Successful requests:", summary["completed"])
    row("Failed requests:", summary["failed"])
    row("Benchmark duration (s):", summary["duration_s"], ".2f")
    row("Total input tokens:", summary["total_input_tokens"])
    row("Total generated tokens:", summary["total_output_tokens"])
    row("Request throughput (req/s):", summary["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", summary["output_throughput"], ".2f")
    row("Total token throughput (tok/s):", summary["total_token_throughput"], ".2f")
    for key in LATENCY_KEYS:
        short = key.removesuffix("_ms").upper()
        lines.append(f"{' ' + LATENCY_TITLES[key] + ' ':-^{w}}")
        stats = summary[key]
        row(f"Mean {short} (ms):", stats["mean"], ".2f")
        row(f"Median {short} (ms):", stats["median"], ".2f")
        row(f"P99 {short} (ms):", stats["p99"], ".2f")
    lines.append(f"{' KV cache (scheduler /metrics) ':-^{w}}")
    row("Prefix cache hit rate:", summary["prefix_cache_hit_rate"], ".2%")
    row("Peak KV cache usage:", summary["peak_kv_cache_usage"], ".2%")
    if summary.get("peak_kv_cache_usage_exact") is False:
        lines.append(f"  (polled: the scheduler's own peak, {summary['scheduler_peak_kv_cache_usage']:.2%}, is an earlier run's)")
    row("Mean KV cache usage:", summary["mean_kv_cache_usage"], ".2%")
    row("Preemptions:", summary["num_preemptions"])
    lines.append("=" * w)
    errors = sorted(summary.get("errors", {}).items(), key=lambda kv: -kv[1])
    for err, n in errors[:MAX_LISTED_ERRORS]:
        lines.append(f"failed x{n}: {err}")
    rest = errors[MAX_LISTED_ERRORS:]
    if rest:
        more = sum(n for _, n in rest)
        lines.append(f"... and {more} more failed requests with {len(rest)} other errors (all in --result-json)")
    if summary.get("num_rejected_too_long"):
        lines.append(
            f"hint: {summary['num_rejected_too_long']} requests were refused as longer than the scheduler's "
            "--max-model-len or pool: shorten them (--max-input-len N for a trace, --prefix-len/--suffix-len/"
            "--input-len, --output-len) or give the scheduler more room"
        )
    return "\n".join(lines)
