"""Requests whose blocks load from outside (vLLM's WAITING_FOR_REMOTE_KVS): the external tier, a prefill engine.

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
``kv_load_failure_policy`` ``recompute``). With hybrid KV-cache groups a load names every
group's blocks (`load_targets`, each under its keyed hash) and is all or nothing: a short
one gives the blocks back and drops the failed keys from the index.

A request that ends while it loads (an abort) keeps its blocks until the load is
reported: the worker is still writing them. A lost worker loses its loads: their
requests start over. A loaded request that waits behind another (a request preempted
after it came back goes ahead of it) gives its blocks back, still cached, if the head
cannot fit while nothing runs: held, they would stop the queue for good.

A decode engine's pull from a prefill engine (P/D disaggregation, pd_connector.py) parks
the same way; it holds the whole prompt, its last partial block too, and a whole prompt
loaded computes its last token again to sample the next (as vLLM's). Its prefill engine
lends blocks until they are read: `lends_read`, `expire_lends`.

A mixin of `Scheduler` (scheduler/sched/scheduler.py), over its waiting queue, its
request maps, the KV-cache manager and the P/D connector.
"""

from __future__ import annotations

from scheduler.core.kv_cache_blocks import KVCacheBlocks
from scheduler.sched.request import Request, RequestStatus


class ExternalKVWait:
    def _init_external_wait(self) -> None:
        # seq_id -> request whose blocks are loading, in the order they were parked.
        self.loading: dict[int, Request] = {}
        # seq_id -> request that ended while loading: its blocks are freed when the load is reported.
        self._load_orphans: dict[int, Request] = {}

    @property
    def loads_external(self) -> bool:
        """Whether blocks may load from outside: an external tier, or a decode engine's connector."""
        return self.kv_cache_manager.external is not None or (self.kv_transfer is not None and self.kv_transfer.config.is_consumer)

    def _external_tokens(self, request: Request, num_hit_tokens: int) -> tuple[int, bool]:
        """Tokens of ``request`` after its ``num_hit_tokens`` hits that load from outside, and
        whether from a prefill engine (a pull, which wins: it holds the whole prompt) rather
        than the external tier."""
        if self.kv_transfer is not None and self.kv_cache_manager.prefix_cache_lookup_enabled(request):
            # NOTE: as vLLM's, a request that skips the prefix cache (prompt logprobs) loads nothing: it computes its prompt.
            num_remote = self.kv_transfer.num_remote_tokens(request, num_hit_tokens)
            if num_remote:
                return num_remote, True
        return self.kv_cache_manager.get_num_external_hits(request, num_hit_tokens), False

    def _park_for_load(self, request: Request, hits: KVCacheBlocks, num_hit_tokens: int, num_external_tokens: int, pull: bool = False) -> bool:
        """Admit ``request`` as a load: its hits and room for ``num_external_tokens`` more,
        which the external tier holds (or a prefill engine: ``pull``). False, nothing
        changed, when they do not fit."""
        kv, block_size = self.kv_cache_manager, self.block_size
        new_blocks = kv.allocate_slots(request, num_external_tokens, num_hit_tokens, hits, full_sequence_must_fit=self.reserve_full_sequence,
                                       watermark_blocks=self.watermark_blocks if self.running else 0, delay_cache=True)
        if new_blocks is None:
            return False
        num_load = -(-num_external_tokens // block_size)
        first = num_hit_tokens // block_size
        targets = kv.load_targets(request.request_id, first, num_load)
        if pull:
            self.kv_transfer.add_pull(request.seq_id, request, targets, num_external_tokens)
        else:
            hashes = request.block_hashes
            kv.external.add_load(request.seq_id, [kv.keyed_hash(hashes[i], g) for g, i, _ in targets], [b for _, _, b in targets])
        num_cached = num_hit_tokens + num_external_tokens
        num_outside = num_cached - len(hits) * block_size
        if kv.prefix_cache_lookup_enabled(request):
            kv.record_prefix_cache_query(request.num_tokens, num_cached, request.num_cached_tokens >= 0, num_outside)
        request.external_load = (num_hit_tokens, num_load, len(hits) * block_size, num_external_tokens, pull)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.waiting.popleft()
        self.loading[request.seq_id] = request
        return True

    def external_loads_done(self, loaded: dict[int, int]) -> int:
        """The worker's ``ExternalKVDone`` (or ``KVTransferDone``'s pulls): load id (seq_id) ->
        blocks read and checked, from the first. Their requests return to the head of the
        waiting queue, in the order they were parked; unknown ids are skipped. Returns how
        many returned."""
        return len(self._loads_done(loaded, fail=False)[0])

    def kv_pulls_done(self, pulled: dict[int, int]) -> tuple[int, list[str]]:
        """``KVTransferDone``'s pulls: as `external_loads_done`, but under the connector's
        ``kv_load_failure_policy`` ``fail`` a request whose pull fell short does not come back:
        its id is returned, for the caller to end it with an error (its blocks stay held until
        then). Returns how many came back, and those ids."""
        fail = self.kv_transfer is not None and self.kv_transfer.config.kv_load_failure_policy == "fail"
        back, failed = self._loads_done(pulled, fail)
        return len(back), [r.request_id for r in failed]

    def _loads_done(self, loaded: dict[int, int], fail: bool) -> tuple[list[Request], list[Request]]:
        kv, block_size = self.kv_cache_manager, self.block_size
        back, failed = [], []
        for seq_id in [s for s in self.loading if s in loaded] + [s for s in loaded if s not in self.loading]:
            request = self.loading.pop(seq_id, None)
            if request is None:
                orphan = self._load_orphans.pop(seq_id, None)
                if orphan is not None:
                    kv.free(orphan)
                continue
            before, num_load, num_device_tokens, num_tokens, pull = request.external_load
            if kv.hybrid:
                num_loaded = self._group_load_done(request, before // block_size, num_load, loaded[seq_id], pull, fail)
                if num_loaded is None:
                    back.append(request)
                    continue
            else:
                num_loaded = max(0, min(loaded[seq_id], num_load))
                if pull:
                    self.kv_transfer.pulled(num_load, num_loaded)
                else:
                    kv.external.loaded(num_load, num_loaded)
            request.external_load = None
            if pull and fail and num_loaded < num_load:
                # NOTE: back in the waiting queue's maps as a waiting request, for the caller to end.
                request.status = RequestStatus.WAITING
                self.waiting.appendleft(request)
                failed.append(request)
                continue
            computed = before + min(num_loaded * block_size, num_tokens)
            if computed == request.num_tokens:
                # As vLLM: a whole prompt loaded computes its last token again, to sample the next. NOTE: cached
                # after, so the block that token is written into again is not shared until it is.
                computed -= 1
                request.num_replay_tokens = 1
            kv.cache_loaded(request, computed)
            request.num_computed_tokens = computed
            # As vLLM: its cached tokens, counted at its first scheduling, are those it got (the failed ones not).
            request.num_external_cached_tokens = computed - num_device_tokens
            # NOTE: one admitted before (preempted, or its worker lost) comes back as a resumed row.
            request.status = RequestStatus.PREEMPTED if request.num_cached_tokens >= 0 else RequestStatus.WAITING
            back.append(request)
        for request in reversed(back):
            self.waiting.appendleft(request)
        return back, failed

    def _group_load_done(self, request: Request, first: int, num_load: int, num_read: int, pull: bool, fail: bool) -> int | None:
        """A load of a hybrid model's ``num_load`` positions from ``first`` ended (external, or a
        ``pull`` from a prefill engine), its first ``num_read`` targets (every group's,
        `load_targets`) read: ``num_load`` when all were, else 0 for a pull the caller fails
        (``fail``: its blocks stay held until it ends), else None: the request gave its blocks
        back and starts over from what the device holds. NOTE: a shorter prefix would need blocks
        where a sliding group's table holds nulls. The external keys that failed leave the index,
        so its next lookup does not loop; a pull is never tried again (its params are spent)."""
        kv = self.kv_cache_manager
        targets = kv.load_targets(request.request_id, first, num_load)
        num_read = max(0, min(num_read, len(targets)))
        if pull:
            self.kv_transfer.pulled(len(targets), num_read)
        else:
            kv.external.loaded(len(targets), num_read)
        if num_read == len(targets):
            return num_load
        if pull and fail:
            return 0
        if not pull:
            hashes = request.block_hashes
            kv.external.drop([kv.keyed_hash(hashes[i], g) for g, i, _ in targets[num_read:]])
        request.external_load = None
        kv.free(request)
        request.num_computed_tokens = 0
        request.num_external_cached_tokens = 0
        request.status = RequestStatus.PREEMPTED if request.num_cached_tokens >= 0 else RequestStatus.WAITING
        return None

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
        if self.kv_transfer is not None:
            # What a prefill engine lent lived in the lost worker's memory.
            for request in self.kv_transfer.clear():
                kv.free(request)

    def expire_lends(self, now: float) -> int:
        """A prefill engine frees the blocks of lent requests whose lease passed (no decode
        engine read them in time). Returns how many."""
        if self.kv_transfer is None or not self.kv_transfer.lent:
            return 0
        gone = self.kv_transfer.expired(now)
        for request in gone:
            self.kv_cache_manager.free(request)
        return len(gone)

    def lends_read(self, request_ids: list[str]) -> int:
        """``KVTransferDone``'s sent: decode engines read these lent requests' blocks; freed."""
        done = self.kv_transfer.sent(request_ids)
        for request in done:
            self.kv_cache_manager.free(request)
        return len(done)

    @property
    def num_loading(self) -> int:
        return len(self.loading)
