"""The simulator's PNG: prefix-cache hit rate against capacity, a line per policy.

Two things a reader must not miss: the y-axis spans the data (hit rates of a few
percent drawn on 0..1 look flat), and policies whose lines coincide are still all
visible (each drawn thinner and with a smaller marker than the one before, on top
of it, and named "= other" in the legend).
"""

from __future__ import annotations

from pathlib import Path

from simulator.result import SimResult

MARKERS = ("o", "s", "^", "D", "v", "x")
LINESTYLES = ("-", "--", "-.", ":")


def y_limits(values: list[float], pad: float = 0.1, min_span: float = 0.02) -> tuple[float, float]:
    """Axis limits within [0, 1] that fit ``values`` with ``pad`` of their span on
    each side (at least ``min_span`` wide, so equal values do not sit on an edge)."""
    if not values:
        return 0.0, 1.0
    lo, hi = min(values), max(values)
    span = max(hi - lo, min_span)
    mid = (lo + hi) / 2
    lo, hi = mid - span * (0.5 + pad), mid + span * (0.5 + pad)
    if lo < 0:
        lo, hi = 0.0, min(1.0, hi - lo)
    if hi > 1:
        lo, hi = max(0.0, lo - (hi - 1)), 1.0
    return lo, hi


def series(results: list[SimResult]) -> dict[str, list[tuple[int, float]]]:
    """policy -> [(num_blocks, first-admission hit rate)], by capacity, in run order.
    A run with a host tier is its own line, "policy + N host blocks", at the hit rate
    of both tiers together."""
    out: dict[str, list[tuple[int, float]]] = {}
    for r in results:
        if r.num_host_blocks:
            out.setdefault(f"{_name(r)} + {r.num_host_blocks} host blocks", []).append((r.num_blocks, r.combined_hit_rate))
        else:
            out.setdefault(_name(r), []).append((r.num_blocks, r.prefix_cache_hit_rate))
    return {policy: sorted(pts) for policy, pts in out.items()}


def legend_labels(lines: dict[str, list[tuple[int, float]]]) -> dict[str, str]:
    """A policy whose points equal an earlier policy's is labelled "policy (= earlier)"."""
    labels: dict[str, str] = {}
    seen: list[str] = []
    for policy, pts in lines.items():
        same = next((other for other in seen if lines[other] == pts), None)
        labels[policy] = policy if same is None else f"{policy} (= {same})"
        seen.append(policy)
    return labels


def plot_hit_rates(results: list[SimResult], path: str | Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import PercentFormatter

    lines = series(results)
    labels = legend_labels(lines)
    fig, ax = plt.subplots(figsize=(8, 5))
    for i, (policy, pts) in enumerate(lines.items()):
        # NOTE: later lines thinner, with smaller markers, drawn on top: a line that
        # coincides with an earlier one shows inside it instead of hiding it.
        ax.plot(
            [x for x, _ in pts], [y for _, y in pts], label=labels[policy],
            marker=MARKERS[i % len(MARKERS)], linestyle=LINESTYLES[i % len(LINESTYLES)],
            markersize=max(3.0, 10.0 - 2.5 * i), linewidth=max(0.8, 3.0 - 0.7 * i), zorder=2 + i,
        )
    ax.set_xlabel("KV cache capacity (blocks)")
    ax.set_ylabel("prefix-cache hit rate, first admissions (tokens; device + host tier)")
    ax.set_ylim(*y_limits([y for pts in lines.values() for _, y in pts]))
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.grid(True, alpha=0.3)
    ax.legend(title="free policy")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _name(r: SimResult) -> str:
    """A run's line: its free policy, its eviction policy, or both where neither is the default."""
    if r.eviction_policy == "lru":
        return r.policy
    return r.eviction_policy if r.policy == "vllm" else f"{r.policy}/{r.eviction_policy}"
