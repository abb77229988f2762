"""Fast-forward of pure decode steps for the offline simulator.

When every running request is decoding (one token a step), nobody can be admitted
and nothing arrives, consecutive steps differ only in token counts, except at
block boundaries. Over k such steps request r (T tokens, T - 1 computed) changes the
pool only

* at steps j with (T + j - 1) % block_size == 0: allocate_slots takes one new block
  from the front of the free queue (evicting its hash, if any);
* at steps j with (T + j) % block_size == 0: allocate_slots caches the block its
  token T + j - 1 completes.

`fast_forward_decode` replays exactly those allocate_slots calls, in step order and
batch order within a step, with each request's tokens brought up to that step, then
appends the rest. The pool ends as stepping one by one would leave it (the
simulator's tests check this).

Why nobody is admitted meanwhile: the stretch starts after a step that admitted
nobody. In it free blocks only decrease and the waiting head's hits only shrink (new
cached blocks hold output tokens unique to their request), so it stays out unless
an eviction takes one of its free hits: the stretch stops before that.
"""

from __future__ import annotations

from collections.abc import Sequence

from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler


def _num_new_blocks(num_tokens: int, num_steps: int, block_size: int) -> int:
    """Blocks a decoding request with ``num_tokens`` tokens takes in ``num_steps`` steps."""
    first = -(num_tokens - 1) % block_size
    return 0 if first >= num_steps else (num_steps - 1 - first) // block_size + 1


def _head_watch_pops(scheduler: Scheduler, max_pops: int) -> int:
    """How many blocks can come off the front of the free queue (at most ``max_pops``)
    before one holding a hash of the waiting head's free prefix hits.

    NOTE: evicting such a hit can let the head in: with chunked prefill its first
    chunk needs a fixed number of new blocks, and losing a free hit (and every hit
    after it in the chain) gives back more free blocks than the eviction took."""
    waiting, running = scheduler.waiting, scheduler.running
    if not waiting or len(running) >= scheduler.max_num_seqs or len(running) >= scheduler.max_num_batched_tokens:
        return max_pops  # the head is not even tried
    hits, _ = scheduler.kv_cache_manager.get_computed_blocks(waiting[0], record_stats=False)
    watched = {b.block_hash for b in hits if b.ref_cnt == 0}
    if not watched:
        return max_pops
    queue = scheduler.kv_cache_manager.block_pool.free_block_queue
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    num = 0
    while num < max_pops and block is not tail and block.block_hash not in watched:
        num += 1
        block = block.next_free_block
    return num


def decode_horizon(scheduler: Scheduler, limit: int) -> int:
    """The most pure decode steps (at most ``limit``) in which no request finishes,
    the new blocks fit in the free queue (no preemption), and the waiting head
    stays out (see `_head_watch_pops`)."""
    running = scheduler.running
    bs = scheduler.block_size
    max_model_len = scheduler.max_model_len
    k = limit
    for r in running:
        k = min(k, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens - 1)
    if k <= 0:
        return 0
    lengths = [r.num_tokens for r in running]

    def pops(steps: int) -> int:
        return sum(_num_new_blocks(n, steps, bs) for n in lengths)

    max_pops = min(pops(k), scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    max_pops = _head_watch_pops(scheduler, max_pops)
    if pops(k) <= max_pops:
        return k
    lo, hi = 0, k  # pops(lo) fits, pops(hi) does not
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if pops(mid) <= max_pops:
            lo = mid
        else:
            hi = mid
    return lo


def fast_forward_decode(scheduler: Scheduler, num_steps: int, output_token_base: Sequence[int]) -> None:
    """Advance every running request ``num_steps`` decode steps (``num_steps`` from
    `decode_horizon`). Request r's k-th output token is output_token_base[r.seq_id] + k."""
    kv = scheduler.kv_cache_manager
    bs = kv.block_size
    running = scheduler.running
    events: set[tuple[int, int]] = set()
    for i, r in enumerate(running):
        n = r.num_tokens
        events.update((j, i) for j in range(-(n - 1) % bs, num_steps, bs))
        events.update((j, i) for j in range(-n % bs, num_steps, bs))
    start = [r.num_tokens for r in running]

    def advance(r: Request, num_tokens: int) -> None:
        base = output_token_base[r.seq_id] - r.num_prompt_tokens
        r.append_output_token_ids(list(range(base + r.num_tokens, base + num_tokens)))
        r.num_computed_tokens = num_tokens - 1

    for j, i in sorted(events):
        r = running[i]
        advance(r, start[i] + j)
        if kv.allocate_slots(r, 1) is None:
            raise RuntimeError(f"fast-forward ran out of blocks at step {j}: decode_horizon was wrong")
    for i, r in enumerate(running):
        advance(r, start[i] + num_steps)
    scheduler.next_step_id += num_steps
    scheduler.num_generation_tokens += num_steps * len(running)
