"""ExternalIO: the external KV tier's saves and loads, on a thread of their own.

A plan's ``ExternalKVOps`` (protocol/worker_messages.py) are done in two halves:

* `stage`, once the plan ran (its forward computed the blocks it saves): the bytes of
  every block to save are gathered into host memory (one gather per layer), before any
  later plan may reuse the block;
* `submit`, right after: the staged saves and the loads go to the I/O thread, which takes
  loads first (a request waits on each; a save only makes a later hit possible). A load of
  a key whose save is still queued reads the staged bytes. Saves past
  ``max_pending_save_bytes`` are dropped (their keys reported removed): a store slower
  than the prefill rate costs hits, not unbounded memory.

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

Payload of a block: every distinct KV tensor's K then V of that block, in order (a
hybrid model's layers of different KV-cache groups share a tensor, moved once), as the
KV tensors hold them (worker/kv/kv_block_bytes.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from protocol.external_kv import BadObject, decode, encode_header
from protocol.worker_messages import ExternalKVOps
from worker.external.store_errors import StoreError
from worker.kv.kv_block_bytes import block_bytes, gather_blocks, write_blocks
from worker.kv.kv_cache import distinct_kv_tensors

log = logging.getLogger("kvpool.worker.external")

# Bytes of staged saves the I/O thread may hold before new ones are dropped.
DEFAULT_MAX_PENDING_SAVE_BYTES = 256 << 20


@dataclass(slots=True)
class IOCounters:
    """Running totals, read by the process loop's metrics (worker/metrics.py)."""

    saved_blocks: int = 0
    saved_bytes: int = 0
    save_seconds: float = 0.0
    save_failures: dict[str, int] = field(default_factory=dict)  # by StoreError reason
    saves_paused: int = 0  # saves not tried: saving was paused after a failure
    saves_dropped: int = 0  # saves not queued: too many bytes of saves were waiting already
    loaded_blocks: int = 0
    loaded_bytes: int = 0
    load_seconds: float = 0.0
    # Blocks a load could not use, by why: missing, or a BadObject reason, or a store error.
    load_failures: dict[str, int] = field(default_factory=dict)


class ExternalIO:
    """Saves and loads between ``kv_caches`` (each (2, blocks, bs, kvh, hd): the distinct
    KV tensors, or one entry per layer, whose shared tensors are moved once) and ``store``."""

    def __init__(self, store, identity: str, kv_caches: list[torch.Tensor], pause_s: float = 30.0,
                 max_pending_save_bytes: int = DEFAULT_MAX_PENDING_SAVE_BYTES):
        self.store = store
        self.identity = identity
        self.kv_caches = distinct_kv_tensors(kv_caches)
        self.pause_s = pause_s
        self.block_bytes = block_bytes(self.kv_caches)
        self.max_pending_save_bytes = max_pending_save_bytes
        self.counters = IOCounters()
        # Two queues, loads first (a request waits on each); the thread sleeps on the condition.
        self._cond = threading.Condition()
        self._loads: deque = deque()
        self._saves: deque = deque()
        # key -> payload of each save queued or being written: a load reads those from here.
        self._pending_saves: dict[str, bytes] = {}
        self._pending_save_bytes = 0
        self._busy = False
        self._stopping = False
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
        raw = gather_blocks(self.kv_caches, ids).numpy()  # (n, block_bytes)
        return [(key, raw[i].tobytes()) for i, key in enumerate(ops.save_keys)]

    def submit(self, staged: list[tuple[str, bytes]], ops: ExternalKVOps | None = None) -> None:
        """Queue the staged saves and the loads of ``ops`` (None: none). A save past
        ``max_pending_save_bytes`` of saves not yet written is dropped (counted, its key
        reported removed): a store slower than the prefill rate must not grow the worker's
        memory without bound."""
        dropped = []
        with self._cond:
            for key, payload in staged:
                if key in self._pending_saves:
                    continue  # the same bytes are on their way
                if self._pending_save_bytes + len(payload) > self.max_pending_save_bytes:
                    dropped.append(key)
                    continue
                self._pending_saves[key] = payload
                self._pending_save_bytes += len(payload)
                self._saves.append((key, payload))
            if ops is not None:
                for load in zip(ops.load_ids, ops.load_keys, ops.load_block_ids, strict=True):
                    self._loads.append(load)
                self._num_pending_loads += len(ops.load_ids)
            self._cond.notify()
        if dropped:
            self.counters.saves_dropped += len(dropped)
            self._report_removed(dropped)

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
        """Wait until every queued save and load is done (tests; a new handshake). False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not (self._loads or self._saves or self._busy), timeout)

    def close(self, timeout: float = 5.0) -> None:
        """Finish what is queued (bounded by ``timeout``), then stop the thread and the store."""
        self.drain(timeout)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self._thread.join(timeout)
        self.store.close()

    # --- the I/O thread --------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                self._busy = False
                self._cond.notify_all()  # drain() may be waiting
                self._cond.wait_for(lambda: self._loads or self._saves or self._stopping)
                if self._stopping:
                    return
                # NOTE: loads first: a request waits on each, while a save only makes a later hit possible.
                job = ("load", *self._loads.popleft()) if self._loads else ("save", *self._saves.popleft())
                self._busy = True
            try:
                if job[0] == "save":
                    self._save(job[1], job[2])
                else:
                    self._load(job[1], job[2], job[3])
            except Exception:  # noqa: BLE001 -- the thread must outlive any one job
                log.exception("external tier: %s failed", job[0])
                if job[0] == "load":
                    self._report_load(job[1], 0)
            finally:
                if job[0] == "save":
                    with self._cond:
                        payload = self._pending_saves.pop(job[1], None)
                        if payload is not None:
                            self._pending_save_bytes -= len(payload)

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
                        self.store.name, e.reason, e, pause)
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
        with self._cond:
            pending = self._pending_saves.get(key)
        if pending is not None:
            # Its save is still queued: the bytes are here, checked as they will be written.
            write_blocks(self.kv_caches, [block_id], pending)
            return None
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
        write_blocks(self.kv_caches, [block_id], payload)
        return None

    def _report_load(self, load_id: int, num_loaded: int) -> None:
        with self._lock:
            self._loaded[load_id] = num_loaded
            self._num_pending_loads -= 1

    def _report_removed(self, keys: list[str]) -> None:
        with self._lock:
            self._removed.extend(keys)
