"""A P/D fleet's KV transfers into one decode engine (simulator/pd_fleet.py): the decode
worker's side of the wire, in virtual time.

The decode engine's scheduler has a consumer `PDConnector` (scheduler/sched/pd_connector.py):
it admits a ``do_remote_prefill`` request as vLLM's NixlConnector does (its own
prefix-cache hits, then the rest of the prompt, its last partial block too, parked while
it is read) and its plan carries the pulls (``KVTransferOps.pull_*``). `PDTransferLink`
stands where the worker stands: it reads them one after another, first in first out,
each ``latency + blocks x block bytes / bandwidth`` (1 GB/s = 1 byte/ns; with hybrid
KV-cache groups a block is one group's at one position, `SimConfig.block_bytes`, and a
pull reads every group's) from the end of the step that planned it, and reports each whole to the scheduler (``kv_pulls_done``) at
its end. The fleet frees the prefill engine's lent blocks at that time too.
"""

from __future__ import annotations

from collections import deque

from protocol.worker_messages import KVTransferOps
from scheduler.sched.scheduler import Scheduler


class PDTransferLink:
    """The pulls into one decode engine at ``gbps`` GB/s plus ``latency_ms`` each, blocks of ``block_bytes``."""

    def __init__(self, block_bytes: int, gbps: float, latency_ms: float):
        self.block_bytes = block_bytes
        self.read_ns_per_block = block_bytes / gbps
        self.latency_ns = round(latency_ms * 1e6)
        self.busy_until = 0  # when the pulls queued so far are done
        self._ends: deque[tuple[int, int, int]] = deque()  # (end ns, pull id, blocks), in end order
        # Counters: pulls, blocks read, the link's busy ns, ns from queued to done (summed).
        self.num_transfers = 0
        self.num_blocks = 0
        self.busy_ns = 0
        self.wait_ns = 0

    def queue(self, ops: KVTransferOps, end_ns: int) -> list[tuple[str, str, int]]:
        """The plan carrying ``ops`` ended at ``end_ns``: queue its pulls. Each one's
        (address, remote request id, end ns): when the prefill engine's lend is read."""
        t, started = max(self.busy_until, end_ns), []
        for pull_id, address, remote_id, blocks in zip(ops.pull_ids, ops.pull_addresses, ops.pull_request_ids, ops.pull_block_ids, strict=True):
            busy = self.latency_ns + round(len(blocks) * self.read_ns_per_block)
            t += busy
            self._ends.append((t, pull_id, len(blocks)))
            started.append((address, remote_id, t))
            self.num_transfers += 1
            self.num_blocks += len(blocks)
            self.busy_ns += busy
            self.wait_ns += t - end_ns
        self.busy_until = t
        return started

    def deliver(self, sched: Scheduler, now_ns: int) -> bool:
        """Pulls done by ``now_ns``, every block read, handed to the scheduler (their
        requests come back); whether there were any."""
        pulled = {}
        while self._ends and self._ends[0][0] <= now_ns:
            _, pull_id, n = self._ends.popleft()
            pulled[pull_id] = n
        if not pulled:
            return False
        back, failed = sched.kv_pulls_done(pulled)
        if failed or back != len(pulled):
            raise RuntimeError(f"pulls {sorted(pulled)}: {back} came back, {failed} failed (the simulated link loses nothing)")
        return True

    def next_event_ns(self) -> int | None:
        return self._ends[0][0] if self._ends else None
