"""Requests whose blocks load from the external tier (vLLM's WAITING_FOR_REMOTE_KVS).

At admission, after the device's and the host tier's hits, the external tier may hold
the request's next blocks (a disk directory written by an earlier run, a store shared
with other engines). Then the request is *parked*, not scheduled: its blocks are
allocated (hits included, so nothing it needs can be evicted), the plan carries their
load, and the worker reads them off the step path while other requests run. No block
of the load is cached (hashed) yet: another request cannot hit memory that is still
being written. When the worker reports the load (``ExternalKVDone``: how many blocks,
from the first, it read and checked), those blocks are cached as if computed, the request
goes back to the head of the waiting queue with its computed tokens, and is admitted as
a request whose prefix is in the cache (its cached tokens, for its usage and vLLM's
prefill stats, are the ones it got); blocks that failed are computed again (vLLM's
``kv_load_failure_policy`` ``recompute``).

A request that ends while it loads (an abort) keeps its blocks until the load is
reported: the worker is still writing them. A lost worker loses its loads: their
requests start over. A loaded request that waits behind another (a request preempted
after it came back goes ahead of it) gives its blocks back, still cached, if the head
cannot fit while nothing runs: held, they would stop the queue for good.

A mixin of `Scheduler` (scheduler/sched/scheduler.py), over its waiting queue, its
request maps and the KV-cache manager.
"""

from __future__ import annotations

from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.sched.request import Request, RequestStatus


class ExternalKVWait:
    def _init_external_wait(self) -> None:
        # seq_id -> request whose blocks are loading, in the order they were parked.
        self.loading: dict[int, Request] = {}
        # seq_id -> request that ended while loading: its blocks are freed when the load is reported.
        self._load_orphans: dict[int, Request] = {}

    def _park_for_load(self, request: Request, hits: list[KVCacheBlock], num_hit_tokens: int, num_external_tokens: int) -> bool:
        """Admit ``request`` as a load: its hits and room for ``num_external_tokens`` more,
        whose blocks the external tier holds. False, nothing changed, when they do not fit."""
        kv, block_size = self.kv_cache_manager, self.block_size
        new_blocks = kv.allocate_slots(request, num_external_tokens, num_hit_tokens, hits, full_sequence_must_fit=self.reserve_full_sequence,
                                       watermark_blocks=self.watermark_blocks if self.running else 0, delay_cache=True)  # fmt: skip
        if new_blocks is None:
            return False
        num_host_blocks = num_hit_tokens // block_size - len(hits)
        num_load = num_external_tokens // block_size
        first = num_hit_tokens // block_size
        kv.external.add_load(request.seq_id, request.block_hashes[first : first + num_load], new_blocks[num_host_blocks : num_host_blocks + num_load])
        num_cached = num_hit_tokens + num_external_tokens
        num_outside = num_cached - len(hits) * block_size
        if kv.prefix_cache_lookup_enabled(request):
            kv.record_prefix_cache_query(request.num_tokens, num_cached, request.num_cached_tokens >= 0, num_outside)
        request.external_load = (num_hit_tokens, num_load, len(hits) * block_size)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting.popleft()
        self.loading[request.seq_id] = request
        return True

    def external_loads_done(self, loaded: dict[int, int]) -> int:
        """The worker's ``ExternalKVDone``: load id (seq_id) -> blocks read and checked, from
        the first. Their requests return to the head of the waiting queue, in the order they
        were parked; unknown ids are skipped. Returns how many returned."""
        kv, block_size = self.kv_cache_manager, self.block_size
        back = []
        for seq_id in [s for s in self.loading if s in loaded] + [s for s in loaded if s not in self.loading]:
            request = self.loading.pop(seq_id, None)
            if request is None:
                orphan = self._load_orphans.pop(seq_id, None)
                if orphan is not None:
                    kv.free(orphan)
                continue
            before, num_load, num_device_tokens = request.external_load
            num_loaded = max(0, min(loaded[seq_id], num_load))
            kv.external.loaded(num_load, num_loaded)
            request.external_load = None
            request.num_computed_tokens = before + num_loaded * block_size
            # As vLLM: its cached tokens, counted at its first scheduling, are those it got (the failed ones not).
            request.num_external_cached_tokens = request.num_computed_tokens - num_device_tokens
            kv.cache_loaded(request, request.num_computed_tokens)
            # NOTE: one admitted before (preempted, or its worker lost) comes back as a resumed row.
            request.status = RequestStatus.PREEMPTED if request.num_cached_tokens >= 0 else RequestStatus.WAITING
            back.append(request)
        for request in reversed(back):
            self.waiting.appendleft(request)
        return len(back)

    def _holds_loaded_blocks(self, request: Request) -> bool:
        """Whether a waiting request holds blocks from a load (it is admitted without a lookup)."""
        return request.request_id in self.kv_cache_manager.req_to_blocks

    def _release_loaded_behind(self, head: Request) -> bool:
        """The head of the waiting queue does not fit and nothing runs: free the blocks of
        waiting requests behind it that hold loaded ones (a request preempted after one came
        back from its load went ahead of it), or nothing would ever run again. Their blocks
        stay cached, hits for them when their turn comes. True if any were freed."""
        kv = self.kv_cache_manager
        holders = [r for r in self.waiting if r is not head and r.request_id in kv.req_to_blocks]
        for request in holders:
            kv.free(request)
            request.num_computed_tokens = 0
        return bool(holders)

    def _end_loading(self, request: Request, status: RequestStatus) -> None:
        """End a request while its blocks load: it is gone for its client now; its blocks stay
        until the worker reports the load (it may still be writing them)."""
        del self.loading[request.seq_id]
        self._load_orphans[request.seq_id] = request
        request.status = status
        del self.requests[request.request_id]
        del self.seq_id_to_request[request.seq_id]

    def abandon_loads(self) -> None:
        """The worker is gone with its loads and its memory: their requests start over, at the
        front of the waiting queue; those that ended meanwhile free their blocks, and so do
        waiting requests whose loads had ended (what they loaded is void)."""
        kv = self.kv_cache_manager
        for orphan in self._load_orphans.values():
            kv.free(orphan)
        self._load_orphans.clear()
        for request in self.waiting:
            if request.request_id in kv.req_to_blocks:
                kv.free(request)
                request.num_computed_tokens = 0
        for request in reversed(list(self.loading.values())):
            request.external_load = None
            self._requeue(request)
        self.loading.clear()
        if kv.external is not None:
            kv.external.clear()

    @property
    def num_loading(self) -> int:
        return len(self.loading)
