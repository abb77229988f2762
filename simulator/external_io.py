"""The worker's external-tier I/O in virtual time, and the simulated tiers' default speeds.

What the real worker does with a plan's ``ExternalKVOps`` (worker/external/external_io.py),
and what the simulator charges for it:

* Before the plan runs, every save is staged: its block's bytes are copied from the device
  to host memory, on the step path. The step is charged ``bytes / stage_gbps`` (the
  host-device link, the host tier's --offload-bandwidth-gbps).
* Once the plan ran, its saves and then its loads go to ONE I/O thread, first in first
  out, while later steps run: a save takes ``block bytes / write_gbps``, a load
  ``latency + blocks read x block bytes / read_gbps``. It stops at the first block the
  store does not hold: the blocks after it are removed from the store too, and all of
  them are computed again (and saved afresh).
* As a load ends the worker tells the scheduler (``ExternalKVDone``): how many blocks it
  read, and which keys the store removed meanwhile (saves past its bound, failed loads).

NOTE: first in first out, a load waits behind every save queued before it: when saves come
faster than the write bandwidth takes them, the queue grows and every load waits longer.
The backlog figures (`backlog_ns`, ``peak_backlog_ns``) show it.

Nothing but this queue touches the store, so each job's effect on it is applied when the
job is queued, in queue order, and its report is delivered at the job's end: the same as
running the job at its time.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.core.offload.external_tier import ExternalOps
from simulator.external_store import SimulatedStore


@dataclass(frozen=True, slots=True)
class TierSpeeds:
    read_gbps: float
    write_gbps: float
    latency_ms: float  # per load


# NOTE: where these come from is in --external-tier's help (simulator/external_args.py).
EXTERNAL_TIER_SPEEDS = {"disk": TierSpeeds(3.0, 2.0, 0.1), "store": TierSpeeds(1.2, 1.2, 1.0)}
# The scheduler's ExternalTier backend (protocol/external_kv.py's BACKENDS) each one stands for.
EXTERNAL_TIER_BACKENDS = {"disk": "disk", "store": "mooncake"}
EXTERNAL_TIERS = ("none", *EXTERNAL_TIER_SPEEDS)


class SimExternalIO:
    """The I/O thread of one simulated worker over ``store``; times in virtual ns (1 GB/s = 1 byte/ns)."""

    def __init__(self, store: SimulatedStore, block_bytes: int, speeds: TierSpeeds, stage_gbps: float):
        self.store = store
        self.block_bytes = block_bytes
        self.save_ns = round(block_bytes / speeds.write_gbps)
        self.read_ns_per_block = block_bytes / speeds.read_gbps
        self.latency_ns = round(speeds.latency_ms * 1e6)
        self.stage_ns_per_block = block_bytes / stage_gbps
        # When the thread is done with everything queued so far.
        self.busy_until = 0
        # (end ns, load id or None, blocks loaded, keys removed), in end order (one thread).
        self._reports: deque[tuple[int, int | None, int, list[str]]] = deque()
        self._load_ends: deque[int] = deque()
        # Counters (blocks, ns).
        self.num_saved = 0
        self.num_loads = 0
        self.num_loaded = 0
        self.num_load_failures = 0
        self.save_busy_ns = 0
        self.load_busy_ns = 0
        self.load_wait_ns = 0  # queued to reported, summed over loads
        self.stage_ns = 0
        self.peak_backlog_ns = 0

    def stage_ns_of(self, ops: ExternalOps | None) -> int:
        """What staging the plan's saves adds to its step."""
        return 0 if ops is None else round(len(ops.save_keys) * self.stage_ns_per_block)

    def submit(self, ops: ExternalOps, at_ns: int) -> None:
        """The plan that carried ``ops`` ran and ended at ``at_ns``: queue its saves, then its loads."""
        self.stage_ns += self.stage_ns_of(ops)
        t = max(self.busy_until, at_ns)
        self.peak_backlog_ns = max(self.peak_backlog_ns, t - at_ns)
        store, block_bytes = self.store, self.block_bytes
        for key in ops.save_keys:
            removed = store.put(key, block_bytes)
            t += self.save_ns
            if removed:
                self._reports.append((t, None, 0, removed))
        self.num_saved += len(ops.save_keys)
        self.save_busy_ns += len(ops.save_keys) * self.save_ns
        for load_id, keys in zip(ops.load_ids, ops.load_keys, strict=True):
            n = 0
            while n < len(keys) and store.get(keys[n]) is not None:
                n += 1
            failed = keys[n:]
            for key in failed[1:]:
                store.remove(key)
            busy = self.latency_ns + round(n * self.read_ns_per_block)
            t += busy
            self._reports.append((t, load_id, n, failed))
            self._load_ends.append(t)
            self.num_loads += 1
            self.num_loaded += n
            self.num_load_failures += len(keys) - n
            self.load_busy_ns += busy
            self.load_wait_ns += t - at_ns
        self.busy_until = t

    def next_load_end(self) -> int | None:
        """When the next load in the queue ends (None: none is queued)."""
        return self._load_ends[0] if self._load_ends else None

    def take_reports(self, now_ns: int) -> tuple[dict[int, int], list[str]]:
        """What the worker has told by ``now_ns`` and not yet: load id -> blocks loaded, keys removed."""
        loaded: dict[int, int] = {}
        removed: list[str] = []
        reports, load_ends = self._reports, self._load_ends
        while reports and reports[0][0] <= now_ns:
            _, load_id, n, keys = reports.popleft()
            if load_id is not None:
                loaded[load_id] = n
                load_ends.popleft()
            removed += keys
        return loaded, removed

    def backlog_ns(self, now_ns: int) -> int:
        """The queued work left at ``now_ns``."""
        return max(0, self.busy_until - now_ns)
