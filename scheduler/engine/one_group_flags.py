"""vLLM 0.32 flags that, with kvpool's one engine and one KV cache group, change nothing
but are checked as vLLM checks them (``python -m scheduler`` takes them from kvpool serve).

* ``--prefix-match-unit N`` (CacheConfig, N > 0): the token boundary a prefix-cache hit
  may land on, finer than a block only across several KV cache groups. With one group
  vLLM's ``resolve_kv_cache_block_sizes`` refuses any N but the block size while prefix
  caching is on (the hits land on blocks) and ignores it while it is off.
* ``--prefill-schedule-interval N`` (SchedulerConfig, N >= 1): admit new prefills every
  N steps, aligned across data-parallel ranks. Only vLLM's DPEngineCoreProc (data
  parallel size > 1, a MoE model) throttles; one engine never does, whatever N.

Both are the settings table's rows (protocol/serve_flags/scheduling.py).
"""

from __future__ import annotations

import argparse


def check_one_group_args(a: argparse.Namespace) -> None:
    """Raise ValueError naming the first bad value (vLLM's wording); then drop both from
    ``a``: nothing downstream reads them."""
    unit, interval = a.prefix_match_unit, a.prefill_schedule_interval
    del a.prefix_match_unit, a.prefill_schedule_interval
    if unit is not None and unit <= 0:
        raise ValueError(f"--prefix-match-unit must be > 0, got {unit}")
    if interval < 1:
        raise ValueError(f"--prefill-schedule-interval must be >= 1, got {interval}")
    if unit not in (None, a.block_size) and a.enable_prefix_caching:
        raise ValueError(
            f"Invalid prefix_match_unit={unit}; with a single KV cache group, prefix-cache hits land on the "
            f"block size ({a.block_size}). Unset it or set it to {a.block_size}."
        )
