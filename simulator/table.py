"""The simulator's table, a row a run (the figures of simulator/result.py), and the
progress line's external-tier part."""

from __future__ import annotations

from simulator.result import SimResult

COLUMNS = (
    ("num_blocks", "blocks", "d"), ("policy", "policy", "s"), ("eviction_policy", "eviction", "s"), ("prefix_cache_hit_rate", "hit rate", ".2%"),
    ("prefix_cache_preempted_hit_rate", "preempted hit rate", ".2%"),
    ("num_evictions", "evictions", "d"), ("num_preemptions", "preemptions", "d"), ("num_rejected", "rejected", "d"),
    ("num_pinned_blocks", "pinned", "d"), ("peak_usage", "peak usage", ".1%"), ("mean_queueing_delay_ms", "mean queue ms", ".1f"), ("wall_s", "wall s", ".1f"),
)


# Shown when a run has speculative decoding: its counts, as vLLM's SpecDecodingLogging.
SPEC_COLUMNS = (
    ("num_speculative_tokens", "spec K", "d"), ("spec_num_drafts", "drafts", "d"), ("spec_num_draft_tokens", "draft tokens", "d"),
    ("spec_num_accepted_tokens", "accepted", "d"), ("spec_draft_acceptance_rate", "draft accept", ".2%"),
    ("spec_mean_acceptance_length", "mean accept len", ".2f"), ("simulated_s", "simulated s", ".1f"),
)


# Shown when a run has a host tier: hit rate by tier (device + host = combined) and bytes moved.
HOST_COLUMNS = (
    ("num_host_blocks", "host blocks", "d"), ("host_hit_rate", "host hit rate", ".2%"),
    ("combined_hit_rate", "both tiers", ".2%"), ("num_host_loads", "loads", "d"),
    ("bytes_stored", "GB stored", "gb"), ("bytes_loaded", "GB loaded", "gb"), ("load_time_s", "load s", ".2f"),
)


# Shown when a run has an external tier: its hit rate, all tiers' (device + host + external),
# blocks and bytes moved, the mean load (queued to done), the I/O queue's peak backlog, and TTFT.
EXTERNAL_COLUMNS = (
    ("external_tier", "ext tier", "s"), ("external_tier_blocks", "ext blocks", "d"), ("external_tier_hit_rate", "ext hit rate", ".2%"),
    ("combined_hit_rate", "all tiers", ".2%"), ("external_tier_blocks_loaded", "ext loaded", "d"),
    ("external_tier_blocks_saved", "ext saved", "d"), ("external_tier_bytes_read", "GB read", "gb"),
    ("external_tier_bytes_written", "GB written", "gb"), ("external_tier_mean_load_ms", "mean load ms", ".1f"),
    ("external_tier_peak_backlog_s", "peak backlog s", ".2f"), ("mean_ttft_ms", "mean TTFT ms", ".1f"),
)


# The share of the run the I/O thread spends saving past which the progress line says the writes cannot keep up.
WRITES_BEHIND = 0.9


def _cell(value, spec: str) -> str:
    return f"{value / 1e9:.2f}" if spec == "gb" else format(value, spec)


def format_table(results: list[SimResult]) -> str:
    external = any(r.external_tier != "none" for r in results)
    tiers = ()
    if any(r.num_host_blocks for r in results):
        tiers = tuple(c for c in HOST_COLUMNS if not (external and c[0] == "combined_hit_rate"))
    if external:
        tiers += EXTERNAL_COLUMNS
    cols = (*COLUMNS[:4], *tiers, *COLUMNS[4:]) if tiers else COLUMNS
    if any(r.num_speculative_tokens for r in results):
        cols = (*cols[:-1], *SPEC_COLUMNS, cols[-1])
    rows = [[h for _, h, _ in cols]]
    rows += [[_cell(getattr(r, k), spec) for k, _, spec in cols] for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(cols))]
    lines = ["  ".join(c.rjust(w) if i not in (1, 2) else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))) for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def external_line(r: SimResult) -> str:
    """The progress line's external-tier part ("" without one); it says when the tier's writes cannot keep up."""
    if r.external_tier == "none":
        return ""
    size = r.external_tier_blocks or "unbounded"
    warm = f", warm ({r.external_tier_warm_blocks} blocks)" if r.external_tier_warm else ""
    saving = r.external_tier_save_s / r.simulated_s if r.simulated_s else 0.0
    behind = ": its writes cannot keep up" if saving >= WRITES_BEHIND else ""
    return (f", {r.external_tier} tier {size}{warm}: {r.external_tier_hit_rate:.2%}, {r.external_tier_bytes_read / 1e9:.2f} GB read, "
            f"{r.external_tier_bytes_written / 1e9:.2f} GB written (saving {saving:.0%} of the time{behind}; "
            f"peak backlog {r.external_tier_peak_backlog_s:.2f} s)")
