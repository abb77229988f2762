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

With a host tier: more host hits only make the head's first chunk longer (a load
needs a fresh block like a computed token), but fewer can make it short enough to
fit. So with a head that has host hits no store of the stretch may evict from the
tier (`_host_store_room`), and the simulator does not start a stretch after a step
whose plan's write-through stores evicted after the head was tried (engine.py).
The tier's copies are taken and completed step by step as stepping does
(`_tier_steps`): evictions' stores in the step of their allocation, write-through
stores in the step after the caching. Equal to stepping on 1,400 random cases and
the tests (tests/simulator/test_offload_sim.py).

With an external tier the same goes for its ops (saves only: a stretch starts no load),
taken step by step and handed to ``on_external_ops`` with their step's index; when a
stretch may start is the simulator's (simulator/external_worker.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from scheduler.core.offload.external_tier import ExternalOps
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler


def num_new_blocks(num_tokens: int, num_steps: int, block_size: int) -> int:
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
    if not waiting or len(running) >= scheduler.max_num_active_seqs or len(running) >= scheduler.step_token_budget:
        return max_pops  # the head is not even tried
    kv = scheduler.kv_cache_manager
    hits, _ = kv.get_computed_blocks(waiting.head, record_stats=False)
    watched = {b.block_hash for group in hits.blocks for b in group if b.ref_cnt == 0 and not b.is_null}
    if not watched:
        return max_pops
    queue = kv.block_pool.free_block_queue
    block, tail = queue.fake_free_list_head.next_free_block, queue.fake_free_list_tail
    num = 0
    while num < max_pops and block is not tail and block.block_hash not in watched:
        num += 1
        block = block.next_free_block
    return num


ExternalOpsSink = Callable[[int, ExternalOps], None]


def _tier_steps(kv, first: int, upto: int, on_external_ops: ExternalOpsSink | None = None) -> None:
    """The tiers' side of steps ``first`` .. ``upto - 1``, after the allocations
    of step ``first`` (if it had any), as stepping does it: each step's plan takes
    its copies (the stores of its evictions, then with write-through those of the
    blocks the step before cached) and its result completes them; so with its
    external ops (the saves of blocks cached in the stretch, in the plan the scheduler
    puts them in). Only step
    ``first`` and the one after it can have any: the others allocate and cache
    nothing."""
    for j in range(first, min(upto, first + 2)):
        if kv.take_tier_copies() is not None:
            kv.complete_tier_copies()
        if on_external_ops is not None and (ops := kv.take_external_ops()) is not None:
            on_external_ops(j, ops)


def _host_store_room(scheduler: Scheduler, max_stores: int) -> int | None:
    """How many stores (of at most ``max_stores``) the stretch may make before one
    evicts a host-tier hit of the waiting head, or None where none can.

    NOTE: a host eviction of one of the head's host hits leaves it fewer computed
    tokens, so a smaller first chunk when the token budget cuts it, which can fit.
    Stores take free slots first, then the policy's victims in its order (entries
    stored in the stretch go behind the others, as stepping completes them)."""
    kv = scheduler.kv_cache_manager
    tier, waiting, running = kv.host_tier, scheduler.waiting, scheduler.running
    if tier is None or not waiting or len(running) >= scheduler.max_num_active_seqs or len(running) >= scheduler.step_token_budget:
        return None
    head = waiting.head
    hits, num_hit_tokens = kv.get_computed_blocks(head, record_stats=False)
    if num_hit_tokens <= len(hits) * kv.block_size:
        return None
    room = tier.num_host_blocks - tier.num_cached_blocks
    if not hasattr(tier.policy, "__iter__"):
        return room  # a policy without an order to read: no eviction at all
    host_hits = set(head.block_hashes[len(hits) : num_hit_tokens // kv.block_size])
    for block_hash in tier.policy:  # eviction order
        if room >= max_stores:
            return None
        if block_hash in host_hits:
            return room
        room += 1
    return None


def _num_filled_blocks(num_tokens: int, num_steps: int, block_size: int) -> int:
    """Blocks a decoding request with ``num_tokens`` tokens fills (and caches) in
    ``num_steps`` steps: at the steps j with (num_tokens + j) % block_size == 0."""
    return (num_tokens + num_steps - 1) // block_size - (num_tokens - 1) // block_size


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
        return sum(num_new_blocks(n, steps, bs) for n in lengths)

    max_pops = min(pops(k), scheduler.kv_cache_manager.block_pool.get_num_free_blocks())
    max_pops = _head_watch_pops(scheduler, max_pops)
    write_through = scheduler.kv_cache_manager.offload_store == "full"

    def fills(steps: int) -> int:
        return sum(_num_filled_blocks(n, steps, bs) for n in lengths)

    # Write-through stores every block filled: those of the step before (one a
    # request at most), then those of the stretch; eviction, one a pop at most.
    room = _host_store_room(scheduler, fills(k) + len(running) if write_through else max_pops)
    if room is not None:
        if write_through:
            room -= len(running)
            if room < 0:
                k = 0
            elif fills(k) > room:
                lo, hi = 0, k  # fills(lo) fits, fills(hi) does not
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if fills(mid) <= room else (lo, mid)
                k = lo
        else:
            max_pops = min(max_pops, room)  # eviction: one store a pop at most
        if k <= 0:
            return 0
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


def fast_forward_decode(scheduler: Scheduler, num_steps: int, output_token_base: Sequence[int],
                        on_external_ops: ExternalOpsSink | None = None) -> None:
    """Advance every running request ``num_steps`` decode steps (``num_steps`` from
    `decode_horizon`). Request r's k-th output token is output_token_base[r.seq_id] + k.
    ``on_external_ops(j, ops)``: step j's external ops (None: no external tier)."""
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

    tier = kv.host_tier is not None or on_external_ops is not None
    pending, current = 0, -1  # the first step whose copies are not yet taken; the step replayed
    for j, i in sorted(events):
        if tier and j != current:
            _tier_steps(kv, pending, j, on_external_ops)
            pending = current = j
        r = running[i]
        advance(r, start[i] + j)
        if kv.allocate_slots(r, 1) is None:
            raise RuntimeError(f"fast-forward ran out of blocks at step {j}: decode_horizon was wrong")
    if tier:
        _tier_steps(kv, pending, num_steps, on_external_ops)
    for i, r in enumerate(running):
        advance(r, start[i] + num_steps)
    scheduler.next_step_id += num_steps
    scheduler.num_generation_tokens += num_steps * len(running)
