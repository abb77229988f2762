"""ExternalIO: the external KV tier's saves and loads, on a thread of their own.

A plan's ``ExternalKVOps`` (protocol/worker_messages.py) are done in two halves:

* `stage`, once the plan ran (its forward computed the blocks it saves): the bytes of
  every block to save are gathered into host memory (one gather per layer), before any
  later plan may reuse the block;
* `submit`, right after: the staged saves, then the loads, go to the I/O thread in that
  order. One thread, first in first out: a load queued after the save of the same key
  reads what that save wrote.

A load writes into its device blocks while later steps run: safe, because the scheduler
schedules no token of those blocks and frees none of them before the load is reported
(`take_done`, sent as ``ExternalKVDone``), and nothing else holds them. Each block read is
checked whole (protocol/external_kv.py) before it is written; a load stops at its first
missing or bad block, and says how many it loaded, from the first. That block is removed
from the store with every block of the load after it (their prefix is being computed
again; each is saved afresh when it is), and their keys reported removed; a store out of
reach removes nothing.

A save that fails (a full disk, a store out of reach) is logged, counted, and reported as
a removed key; saving then pauses for ``pause_s`` (loads go on), so a full disk costs one
failure per pause, not one per block. A store whose "full" passes by itself (Mooncake's
master evicts in the background) names a shorter pause for it: ``full_pause_s``.

Payload of a block: every layer's K then V of that block, in layer order, as the KV
tensors hold them.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from protocol.external_kv import BadObject, decode, encode_header
from protocol.worker_messages import ExternalKVOps
from worker.external.store_errors import StoreError

log = logging.getLogger("kvpool.worker.external")

_STOP = object()


@dataclass(slots=True)
class IOCounters:
    """Running totals, read by the process loop's metrics (worker/metrics.py)."""

    saved_blocks: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0
    save_failures: dict[str, int] = field(default_factory=dict)  # by StoreError reason
    saves_paused: int = 0  # saves not tried: saving was paused after a failure
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    # Blocks a load could not use, by why: missing, or a BadObject reason, or a store error.
    load_failures: dict[str, int] = field(default_factory=dict)


class ExternalIO:
    """Saves and loads between ``kv_caches`` (one per layer, (2, blocks, bs, kvh, hd)) and ``store``."""

    def __init__(self, store, identity: str, kv_caches: list[torch.Tensor], pause_s: float = 30.0):
        self.store = store
        self.identity = identity
        self.kv_caches = kv_caches
        self.pause_s = pause_s
        first = kv_caches[0]
        self._block_shape = (len(kv_caches), 2, *first.shape[2:])
        self._dtype = first.dtype
        self.block_bytes = len(kv_caches) * 2 * first[0, 0].numel() * first.element_size()
        self.counters = IOCounters()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._loaded: dict[int, int] = {}
        self._removed: list[str] = []
        self._num_pending_loads = 0
        self._paused_until = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-external-io", daemon=True)
        self._thread.start()

    # --- the step's side (the process loop's thread) -----------------------------------

    def stage(self, ops: ExternalKVOps) -> list[tuple[str, bytes]]:
        """The (key, payload) of every save of ``ops``: call once the plan ran, before the next."""
        ids = ops.save_block_ids
        if not ids:
            return []
        index = torch.tensor(ids, dtype=torch.long, device=self.kv_caches[0].device)
        # (layers, 2, n, bs, kvh, hd) -> (n, layers, 2, bs, kvh, hd): a block's bytes contiguous.
        gathered = torch.stack([kv.index_select(1, index) for kv in self.kv_caches]).transpose(0, 2).transpose(1, 2)
        raw = gathered.contiguous().cpu().view(torch.uint8).reshape(len(ids), -1).numpy()
        return [(key, raw[i].tobytes()) for i, key in enumerate(ops.save_keys)]

    def submit(self, staged: list[tuple[str, bytes]], ops: ExternalKVOps) -> None:
        """Queue the staged saves, then the plan's loads."""
        for key, payload in staged:
            self._queue.put(("save", key, payload))
        if ops.load_ids:
            with self._lock:
                self._num_pending_loads += len(ops.load_ids)
            for load_id, keys, block_ids in zip(ops.load_ids, ops.load_keys, ops.load_block_ids, strict=True):
                self._queue.put(("load", load_id, keys, block_ids))

    @property
    def saving_paused(self) -> bool:
        return time.monotonic() < self._paused_until

    @property
    def has_pending_loads(self) -> bool:
        return self._num_pending_loads > 0

    def take_done(self) -> tuple[dict[int, int], list[str]] | None:
        """Loads ended and keys removed since the last call; None when there are none."""
        with self._lock:
            if not self._loaded and not self._removed:
                return None
            loaded, self._loaded = self._loaded, {}
            removed, self._removed = self._removed, []
        return loaded, removed

    def drain(self, timeout: float) -> bool:
        """Wait until every queued save and load is done (tests; shutdown). False on timeout."""
        done = threading.Event()
        self._queue.put(done)
        return done.wait(timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued (bounded by ``timeout``), then stop the thread and the store."""
        self._queue.put(_STOP)
        self._thread.join(timeout)
        self.store.close()

    # --- the I/O thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is _STOP:
                return
            if isinstance(job, threading.Event):
                job.set()
                continue
            try:
                if job[0] == "save":
                    self._save(job[1], job[2])
                else:
                    self._load(job[1], job[2], job[3])
            except Exception:  # noqa: BLE001 -- the thread must outlive any one job
                log.exception("external tier: %s failed", job[0])
                if job[0] == "load":
                    self._report_load(job[1], 0)

    def _save(self, key: str, payload: bytes) -> None:
        c = self.counters
        if time.monotonic() < self._paused_until:
            c.saves_paused += 1
            self._report_removed([key])
            return
        t0 = time.perf_counter()
        try:
            removed = self.store.put(key, encode_header(self.identity, key, payload), payload)
        except StoreError as e:
            c.save_failures[e.reason] = c.save_failures.get(e.reason, 0) + 1
            # NOTE: a store that evicts in the background (Mooncake) is briefly full as a matter of course: its own, shorter pause.
            pause = getattr(self.store, "full_pause_s", self.pause_s) if e.reason == "full" else self.pause_s
            self._paused_until = time.monotonic() + pause
            log.warning("external tier (%s): a save failed (%s): %s; saving pauses for %g s, serving goes on",
                        self.store.name, e.reason, e, pause)  # fmt: skip
            self._report_removed([key])
            return
        c.save_seconds += time.perf_counter() - t0
        c.saved_blocks += 1
        c.saved_bytes += len(payload)
        if removed:
            self._report_removed(removed)

    def _load(self, load_id: int, keys: list[str], block_ids: list[int]) -> None:
        c = self.counters
        t0 = time.perf_counter()
        num_loaded = 0
        bad: list[str] = []
        for i, (key, block_id) in enumerate(zip(keys, block_ids, strict=True)):
            why = self._load_one(key, block_id)
            if why is not None:
                c.load_failures[why] = c.load_failures.get(why, 0) + 1
                if why not in ("unreachable", "io"):
                    # As vLLM evicts a failed block's dependents: the blocks after a bad one go
                    # too, so that each is saved again once computed, not kept as it was.
                    bad = keys[i:]
                    for later in bad[1:]:
                        self.store.remove(later)
                break
            num_loaded += 1
        c.load_seconds += time.perf_counter() - t0
        c.loaded_blocks += num_loaded
        c.loaded_bytes += num_loaded * self.block_bytes
        if bad:
            self._report_removed(bad)
        self._report_load(load_id, num_loaded)

    def _load_one(self, key: str, block_id: int) -> str | None:
        """Read, check and write one block; None when done, else why not."""
        try:
            data = self.store.get(key)
        except StoreError as e:
            log.warning("external tier (%s): a load failed (%s): %s", self.store.name, e.reason, e)
            return "unreachable" if e.reason == "unreachable" else "io"
        if data is None:
            return "missing"
        try:
            payload = decode(data, self.identity, key, self.block_bytes)
        except BadObject as e:
            log.warning("external tier (%s): object %s refused (%s); the block is computed again", self.store.name, key, e)
            self.store.remove(key)
            return e.reason
        block = torch.frombuffer(bytearray(payload), dtype=torch.uint8).view(self._dtype).view(self._block_shape)
        for layer, kv in enumerate(self.kv_caches):
            kv[:, block_id].copy_(block[layer])
        return None

    def _report_load(self, load_id: int, num_loaded: int) -> None:
        with self._lock:
            self._loaded[load_id] = num_loaded
            self._num_pending_loads -= 1

    def _report_removed(self, keys: list[str]) -> None:
        with self._lock:
            self._removed.extend(keys)
