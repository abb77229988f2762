"""A P/D fleet's KV transfers into one decode engine (simulator/pd_fleet.py), through the
scheduler's own parking (scheduler/sched/external_wait.py).

A decode engine is given, as its KV-cache manager's external tier, an `ExternalTier` over
`PrefilledKeys`: the keys of the prompt blocks that prefill engines hold for the requests
handed to this engine and not yet read. So a request is admitted as vLLM's NixlConnector
admits a ``do_remote_prefill`` one: its own prefix-cache hits first, then the rest of the
prompt's blocks are allocated and the request parks (WAITING_FOR_REMOTE_KVS) while they
are read; once read they are cached as computed, and the request computes what is left of
its prompt and samples its first token. A request reads once: its keys leave the index
when its read is queued, so one preempted later computes what it lost (its prefill
engine has freed the blocks by then).

`PDTransferLink` is the decode engine's side of the wire, in virtual time: reads go one
after another, first in first out, each ``latency + blocks x block bytes / bandwidth``
(1 GB/s = 1 byte/ns). It stands where the simulated external tier's worker
(simulator/external_worker.py) stands in `_Run` (simulator/engine.py), with its methods.

NOTE: the external tier's lookup stops before the block holding the last prompt token
(``KVCacheManager.get_num_external_hits``), so a prompt's last partial block is not read
but computed again with its last token, where vLLM reads it and computes one token.
NOTE: a decode engine saves nothing (`PrefilledKeys.missing` is all False): the tier's
write-through saves are all skipped.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Iterable, Sequence

from protocol.external_kv import kv_identity
from scheduler.core.external_tier import ExternalOps, ExternalTier
from scheduler.core.kv_cache_block import BlockHash
from scheduler.sched.scheduler import Scheduler


class PrefilledKeys:
    """The external tier's index on a decode engine: a multiset of keys (two requests in
    flight may carry the same prefix, each from its own prefill engine)."""

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def count_prefix(self, keys: Sequence[str]) -> int:
        n = 0
        for key in keys:
            if not self.counts[key]:
                break
            n += 1
        return n

    def missing(self, keys: Sequence[str]) -> list[bool]:
        return [False] * len(keys)

    def add(self, keys: Iterable[str]) -> None:
        self.counts.update(keys)

    def discard(self, keys: Iterable[str]) -> None:
        self.counts.subtract(keys)
        self.counts = +self.counts  # NOTE: drops keys at 0, so the index does not grow with the run

    def reset(self, keys: Iterable[str]) -> None:
        self.counts = Counter(keys)


class PDTransferLink:
    """The reads into one decode engine at ``gbps`` GB/s plus ``latency_ms`` each, blocks of
    ``block_bytes``; ``tier`` goes to its KV-cache manager."""

    def __init__(self, block_size: int, block_bytes: int, gbps: float, latency_ms: float):
        self.index = PrefilledKeys()
        self.tier = ExternalTier("nixl", block_size, self.index)
        self.tier.attach(kv_identity("kvpool-simulator-pd", "", "", block_size, 0, 0, 0), ())
        self.block_bytes = block_bytes
        self.read_ns_per_block = block_bytes / gbps
        self.latency_ns = round(latency_ms * 1e6)
        self.busy_until = 0  # when the reads queued so far are done
        self.expected: dict[int, list[str]] = {}  # seq_id -> its prompt's keys, handed over and not read
        self._ends: deque[tuple[int, int, int]] = deque()  # (end ns, seq_id, blocks), in end order
        self.started: list[tuple[int, int]] = []  # (seq_id, end ns) of reads queued, not yet taken
        self.loads_returned = False
        # Counters: reads, blocks read, the link's busy ns, ns from queued to done (summed).
        self.num_transfers = 0
        self.num_blocks = 0
        self.busy_ns = 0
        self.wait_ns = 0

    def expect(self, seq_id: int, block_hashes: Sequence[BlockHash]) -> None:
        """Request ``seq_id`` is handed over: a prefill engine holds its prompt's full blocks."""
        keys = self.tier.keys(block_hashes)
        self.expected[seq_id] = keys
        self.index.add(keys)

    def forget(self, seq_id: int) -> bool:
        """Drop the request's keys from the index; False when gone already (its read was queued)."""
        keys = self.expected.pop(seq_id, None)
        if keys is None:
            return False
        self.index.discard(keys)
        return True

    def take_started(self) -> list[tuple[int, int]]:
        """The (seq_id, end ns) of reads queued since the last call."""
        started, self.started = self.started, []
        return started

    # --- as `_Run` drives an external tier's worker ------------------------------------------

    def stage_ns(self, ops: ExternalOps | None) -> int:
        return 0  # nothing is saved, so nothing is staged

    def ran(self, sched: Scheduler, ops: ExternalOps, end_ns: int) -> None:
        """The plan carrying ``ops`` ended at ``end_ns``: queue its reads."""
        t = max(self.busy_until, end_ns)
        for seq_id, keys in zip(ops.load_ids, ops.load_keys, strict=True):
            busy = self.latency_ns + round(len(keys) * self.read_ns_per_block)
            t += busy
            self._ends.append((t, seq_id, len(keys)))
            self.started.append((seq_id, t))
            self.forget(seq_id)
            self.num_transfers += 1
            self.num_blocks += len(keys)
            self.busy_ns += busy
            self.wait_ns += t - end_ns
        self.busy_until = t

    def deliver(self, sched: Scheduler, now_ns: int) -> None:
        """Reads done by ``now_ns``, handed to the scheduler (their requests come back)."""
        loaded = {}
        while self._ends and self._ends[0][0] <= now_ns:
            _, seq_id, n = self._ends.popleft()
            loaded[seq_id] = n
        self.loads_returned = bool(loaded)
        if loaded:
            sched.external_loads_done(loaded)

    def next_event_ns(self) -> int | None:
        return self._ends[0][0] if self._ends else None

    def allows_fast_forward(self, sched: Scheduler, ops: ExternalOps | None) -> bool:
        return not self.loads_returned and not (ops is not None and ops.load_ids)

    def num_steps_before(self, gap_ns: int, step_ns: int, num_running: int) -> int:
        return -(-gap_ns // step_ns)  # nothing staged: whole steps
