"""The external tier in one simulated run: the scheduler's real ExternalTier, and the worker's side.

The scheduler's side is the server's own: an `ExternalTier` over a `KnownKeys` index in
the KV-cache manager, and the scheduler's parking (scheduler/sched/external_wait.py).
The worker's side is simulated as the real worker behaves (worker/process.py, handling
``ExternalKVDone``; worker/external/external_io.py): each plan's ``external`` ops are
staged in its step and queued once it ran (`SimExternalIO`, over the `SimulatedStore`);
the loads' ends and the keys the store removed reach the scheduler as the server's
``WorkerSide._on_external_done`` hands them over: ``ExternalTier.removed``, then
``Scheduler.external_loads_done``, before the first plan after their time.

Fast-forward (simulator/fastforward.py) with the tier: a stretch ends before the next
load ends; it starts only after a step that neither started a load nor got one back
(a request back from a load may be admitted), and with a bounded store only with nobody
waiting (a key the store removes can change what the waiting head finds). The stretch's
saves are taken step by step, staged and queued at their steps' times, as stepping does.
"""

from __future__ import annotations

import math

from protocol.external_kv import kv_identity
from scheduler.core.offload.external_tier import ExternalOps, ExternalTier, KnownKeys
from scheduler.sched.scheduler import Scheduler
from simulator.external_io import EXTERNAL_TIER_BACKENDS, SimExternalIO, TierSpeeds
from simulator.external_store import SimulatedStore


class SimExternalWorker:
    """The tier of one run (``tier``: give it to the KV-cache manager) over ``store``."""

    def __init__(self, kind: str, block_size: int, block_bytes: int, speeds: TierSpeeds, stage_gbps: float, store: SimulatedStore):
        self.kind = kind
        self.store = store
        self.block_size = block_size
        self.tier = ExternalTier(EXTERNAL_TIER_BACKENDS[kind], block_size, KnownKeys())
        # As a worker's hello: its identity, and what its store holds (a warm start: the first replay's).
        self.tier.attach(kv_identity("kvpool-simulator", "", "", block_size, 0, 0, 0), store.keys())
        self.num_warm_blocks = len(store)
        self.io = SimExternalIO(store, block_bytes, speeds, stage_gbps)
        # Tokens found in the tier at first admissions (re-admissions after a preemption apart).
        self.num_hit_tokens = 0
        self.num_preempted_hit_tokens = 0
        # Whether the last delivery brought loads back (the step after may admit them).
        self.loads_returned = False

    def deliver(self, sched: Scheduler, now_ns: int) -> None:
        """What the worker has reported by ``now_ns``, handed to the scheduler."""
        loaded, removed = self.io.take_reports(now_ns)
        if removed:
            self.tier.removed(removed)
        self.loads_returned = bool(loaded)
        if loaded:
            sched.external_loads_done(loaded)

    def stage_ns(self, ops: ExternalOps | None) -> int:
        return self.io.stage_ns_of(ops)

    def ran(self, sched: Scheduler, ops: ExternalOps, end_ns: int) -> None:
        """The plan carrying ``ops`` (``plan.external``) ended at ``end_ns``: count its loads' hits, queue its I/O."""
        for load_id in ops.load_ids:
            request = sched.loading[load_id]
            # NOTE: the tokens the manager found, not the keys: with hybrid groups a position has a key per group it loads.
            _, _, _, num_tokens, _ = request.external_load  # (hits before, blocks, device tokens, tokens, pull)
            # NOTE: as _park_for_load counts it: a request scheduled before is a re-admission.
            if request.num_cached_tokens >= 0:
                self.num_preempted_hit_tokens += num_tokens
            else:
                self.num_hit_tokens += num_tokens
        self.io.submit(ops, end_ns)

    def next_event_ns(self) -> int | None:
        """When the next load ends (None: none queued): the scheduler has news then."""
        return self.io.next_load_end()

    def allows_fast_forward(self, sched: Scheduler, ops: ExternalOps | None) -> bool:
        """Whether a decode stretch may follow a step whose plan carried ``ops`` (see the module doc)."""
        if self.loads_returned or (ops is not None and ops.load_ids):
            return False
        return not self.store.max_blocks or not sched.waiting

    def num_steps_before(self, gap_ns: int, step_ns: int, num_running: int) -> int:
        """How many decode steps of ``step_ns`` plus their staging start within ``gap_ns`` (at
        least: a request fills at most one block a step, saved by that step's plan or the next)."""
        per_block = self.io.stage_ns_per_block
        bs = self.block_size

        def start(j: int) -> int:  # an upper bound on when step j starts
            return j * step_ns + math.ceil(num_running * -(-j // bs) * per_block) + j

        lo, hi = 0, -(-gap_ns // step_ns)  # start(lo) < gap; start(hi) >= gap
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if start(mid) < gap_ns else (lo, mid)
        return lo + 1

    def figures(self, now_ns: int, num_queries: int) -> dict:
        """The result's external-tier figures (simulator/result.py) at the end of the run."""
        io, tier = self.io, self.tier
        return dict(
            external_tier=self.kind,
            external_tier_blocks=self.store.max_blocks,
            external_tier_warm_blocks=self.num_warm_blocks,
            external_tier_hit_rate=self.num_hit_tokens / num_queries if num_queries else 0.0,
            external_tier_hit_tokens=self.num_hit_tokens,
            external_tier_preempted_hit_tokens=self.num_preempted_hit_tokens,
            external_tier_loads=io.num_loads,
            external_tier_blocks_loaded=io.num_loaded,
            external_tier_load_failures=io.num_load_failures,
            external_tier_blocks_saved=io.num_saved,
            external_tier_saves_skipped=tier.num_saves_skipped,
            external_tier_evictions=self.store.num_evictions,
            external_tier_bytes_read=io.num_loaded * io.block_bytes,
            external_tier_bytes_written=io.num_saved * io.block_bytes,
            external_tier_mean_load_ms=io.load_wait_ns / io.num_loads / 1e6 if io.num_loads else 0.0,
            external_tier_stage_s=io.stage_ns / 1e9,
            external_tier_save_s=io.save_busy_ns / 1e9,
            external_tier_load_s=io.load_busy_ns / 1e9,
            external_tier_peak_backlog_s=io.peak_backlog_ns / 1e9,
            external_tier_end_backlog_s=io.backlog_ns(now_ns) / 1e9,
        )
