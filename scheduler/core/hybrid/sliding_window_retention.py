"""Which full blocks of a sliding-window group are cached: vLLM 0.32's sparse retention
at its serving default, ``prefix_cache_retention_interval = 0``
(``SlidingWindowManager.reachable_block_mask``, ``single_type_kv_cache_manager.py``).

A sliding-window hit at a prefix of L tokens needs only the ``cdiv(W - 1, block_size)``
blocks that end at L (the window of the next token). vLLM caches (hashes) only those
tails that a later request can resume at -- the "reachable boundaries":

* the replay boundary ``num_prompt_tokens - 1`` (``kv_cache_coordinator.replay_boundaries``,
  no EAGLE): a resend of the prompt hits at most ``num_tokens - 1`` tokens, and a longer
  request sharing the prompt hits its whole blocks below that;
* the request's shared-prefix junction (vLLM's ``request.shared_prefix_boundary``), where
  another request's full-attention hit ran past the sliding groups' hit at admission.

Each boundary is floored to a block (the hit alignment: one block size, no partial
hash hits). Every other full block of a sliding group is never hashed: once the window
leaves it, it is freed as an uncached block. Full-attention groups cache every block.
"""

from __future__ import annotations

from collections.abc import Iterable


def retained_block_runs(start_block: int, end_block: int, num_tail_blocks: int,
                        boundaries: Iterable[int], block_size: int) -> list[tuple[int, int]]:
    """The blocks ``i`` of ``start_block <= i < end_block`` to cache, as ascending,
    disjoint runs ``[lo, hi)``: those among the ``num_tail_blocks`` blocks that end at
    each boundary (in tokens, floored to a block)."""
    runs: list[tuple[int, int]] = []
    for boundary in sorted(boundaries):
        end = boundary // block_size
        lo, hi = max(start_block, end - num_tail_blocks), min(end_block, end)
        if lo >= hi:
            continue
        if runs and lo <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    return runs
