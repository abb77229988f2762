"""The offline simulator's loop: the real Scheduler, KVCacheManager and BlockPool,
no worker, virtual time.

Each step: requests whose arrival time has come are queued (or rejected, by the
server's own checks: scheduler/sched/validation.py);
`Scheduler.schedule()` plans a step; the step takes
``step_overhead + per_token * num_scheduled_tokens`` of virtual time; then a
stand-in worker samples one token, unique to its request, for every row that
completed its tokens, and `Scheduler.update_from_output` applies it. With nothing
to run the clock jumps to the next arrival. Time is integer nanoseconds, so a run is
exactly reproducible and fast-forwarding changes nothing.

Pure decode stretches are fast-forwarded (simulator/fastforward.py).

Speculative decoding (``num_speculative_tokens`` K > 0): the scheduler runs with a
SpeculativeConfig and the simulator's drafter (simulator/spec_decode.py): every decoding
request drafts K tokens a step, each accepted with probability ``spec_acceptance_rate``
until the first rejection. Drafts are scheduled tokens, so a step pays for verifying
them; the stand-in worker samples the request's own next token at every position and
keeps the drafts that match (StepResult.extra_token_ids). NOTE: no fast-forward then:
a stretch of such steps draws acceptances and moves each request by a random count.

With a host tier (``num_host_blocks``, the scheduler's own HostTier) a plan carries
the tier's copies: its loads add ``bytes / offload_bandwidth_gbps`` to the step
(they run before its tokens); its stores add nothing (the worker overlaps them).

With an external tier (``external_tier`` "disk" or "store": the scheduler's own
ExternalTier and parking, simulator/external_worker.py) a plan carries its saves and
loads: staging the saves adds ``bytes / offload_bandwidth_gbps`` to the step, and a
plan of saves or loads alone runs too, costing only that; the loads end later, off the
step path, and their requests come back to the waiting queue then. With nothing to run
the clock jumps to the next arrival or the next load's end.

One run is an `EngineRun`; `simulate` (simulator/replay.py) replays a workload through
a fresh one and reads its figures; a fleet (simulator/fleet.py) steps several.
"""

from __future__ import annotations

import random

from protocol.client_messages import Generate
from protocol.speculative_config import SpeculativeConfig
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.pd_connector import PDConnector
from scheduler.sched.policy_options import policy_kwargs
from scheduler.sched.priority_scheduler import scheduler_class
from scheduler.sched.request import Request
from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate
from simulator.config import SimConfig
from simulator.external_store import SimulatedStore
from simulator.external_worker import SimExternalWorker
from simulator.fastforward import decode_horizon, fast_forward_decode
from simulator.result import NOT_YET
from simulator.retention import pin_first_prefix, retention_manager
from simulator.spec_decode import AcceptanceDrafter, num_accepted
from simulator.workload import OUTPUT_TOKEN_BASE, Workload


class EngineRun:
    """One simulation: the scheduler and its pool, the virtual clock (ns), the next
    arrival in arrival order, each request's times and the run's counts."""

    __slots__ = ("cfg", "workload", "specs", "n", "order", "token_base", "tier", "kv", "sched", "hasher", "limits",
                 "block_bytes", "overhead_ns", "per_token_ns", "admit_ns", "first_token_ns", "finish_ns",
                 "next_arrival", "now", "num_rejected", "num_steps", "num_ff_steps", "num_loads", "horizon_ns",
                 "finished_seq_ids", "spec_k", "external", "stage_ns")

    def __init__(self, workload: Workload, cfg: SimConfig, replica: int = 0, store: SimulatedStore | None = None,
                 kv_transfer: PDConnector | None = None):
        """``kv_transfer``: the scheduler's P/D connector (a P/D fleet's engines: simulator/pd_fleet.py)."""
        bs = cfg.block_size
        self.cfg, self.workload = cfg, workload
        self.specs = workload.specs
        self.n = n = len(self.specs)
        self.order = sorted(range(n), key=lambda i: self.specs[i].arrival_ns)
        self.token_base = workload.output_token_base
        self.tier = HostTier(cfg.num_host_blocks, bs) if cfg.num_host_blocks else None
        self.block_bytes = cfg.block_bytes()  # one group's block: a tier's unit
        self.external = None
        if cfg.external_tier != "none":
            store = SimulatedStore(cfg.external_tier_blocks) if store is None else store
            self.external = SimExternalWorker(cfg.external_tier, bs, self.block_bytes, cfg.external_speeds(), cfg.offload_bandwidth_gbps, store)
        self.stage_ns = 0  # the last step's staging of external saves
        kwargs = {} if self.external is None else {"external_tier": self.external.tier}
        self.kv = retention_manager(cfg.num_blocks, bs, cfg.max_model_len, cfg.policy, cfg.eviction_policy, cfg.scheduling_policy,
                                    cfg.max_pinned_fraction, cfg.group_windows, cfg.max_num_batched_tokens, host_tier=self.tier,
                                    offload_store=cfg.offload_store, **kwargs)
        self.spec_k = k = cfg.num_speculative_tokens
        speculative = SpeculativeConfig(k, 1, 1) if k > 0 else None
        self.sched = scheduler_class(cfg.scheduling_policy)(
            self.kv, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_model_len, cfg.reserve_full_sequence,
            speculative=speculative, kv_transfer=kv_transfer, **policy_kwargs(cfg),
        )
        if speculative is not None:
            # NOTE: a fleet's replicas (``replica``) draw apart, each from its own seeded stream.
            rng = random.Random(cfg.spec_seed * 1_000_003 + replica)
            self.sched.proposer = AcceptanceDrafter(k, cfg.spec_acceptance_rate, cfg.max_model_len, self.token_base, rng)
        self.hasher = BlockHasher(bs, cfg.hash_algo)
        if cfg.pin_prefix_tokens >= bs and n:
            pin_first_prefix(self.kv, workload, self.order[0], self.hasher, cfg.pin_prefix_tokens // bs)
        # NOTE: prompt token ids lie below the output ones (simulator/workload.py).
        self.limits = RequestLimits(OUTPUT_TOKEN_BASE, cfg.max_model_len, bs, cfg.num_blocks - 1, self.kv.num_blocks_needed)
        self.overhead_ns = round(cfg.step_overhead_ms * 1e6)
        self.per_token_ns = round(cfg.ms_per_token * 1e6)
        self.admit_ns, self.first_token_ns, self.finish_ns = [NOT_YET] * n, [NOT_YET] * n, [NOT_YET] * n
        self.next_arrival = self.now = 0
        self.num_rejected = self.num_steps = self.num_ff_steps = self.num_loads = 0
        # NOTE: a fleet (simulator/fleet.py) hands requests to this run as its router
        # picks them: ``order`` grows, and no arrival can come before ``horizon_ns``
        # (None: none will come) once the requests in ``order`` are all admitted.
        self.horizon_ns: int | None = None
        self.finished_seq_ids: list[int] = []  # in finishing order

    def run(self) -> None:
        """Step until every request has arrived and none is left; with nothing to run,
        jump to the next arrival (or the next external load's end)."""
        sched, tier, external = self.sched, self.tier, self.external
        while True:
            self.admit_arrivals()
            if external is not None:
                external.deliver(sched, self.now)
            host_evictions = tier.num_evictions if tier is not None else 0
            out = sched.schedule()
            if out is None:
                t = self.next_event_ns()
                if t is None:
                    if sched.has_unfinished_requests():
                        raise RuntimeError(f"simulation stuck: requests left but nothing can be scheduled{self.stuck_reason()}")
                    return
                self.now = t
                continue
            step_ns, num_sampled, any_finished = self.step(out)
            # NOTE: fast-forward replays one group's decode allocations; hybrid groups step every decode.
            if self.cfg.fast_forward and self.kv.num_groups == 1 and self.is_repeatable_decode(out, num_sampled, any_finished, host_evictions):
                self.fast_forward(step_ns)

    def stuck_reason(self) -> str:
        """Why nothing can be scheduled, where the simulator can tell ("" where not)."""
        sched, kv = self.sched, self.kv
        held = [(r.request_id, len(kv.req_to_blocks[r.request_id])) for r in list(sched.waiting)[1:] if r.request_id in kv.req_to_blocks]
        if not held or sched.running:
            return ""
        # NOTE: a request back from an external load keeps its blocks while it waits; a request preempted
        # after it went back ahead of it, and cannot fit without those blocks (a scheduler deadlock).
        return (f": request {held[0][0]!r}, back from an external load, holds {held[0][1]} blocks behind the waiting head "
                f"{sched.waiting.head.request_id!r} (preempted after it), which cannot fit without them")

    def next_event_ns(self) -> int | None:
        """When something next comes when nothing runs: an arrival, or an external load's end."""
        times = []
        if self.next_arrival < len(self.order):
            times.append(self.specs[self.order[self.next_arrival]].arrival_ns)
        if self.external is not None and (t := self.external.next_event_ns()) is not None:
            times.append(t)
        return min(times, default=None)

    def admit_arrivals(self) -> None:
        """Queue every request whose arrival time has come, or reject it as the server
        would (scheduler/sched/validation.py)."""
        specs, order = self.specs, self.order
        while self.next_arrival < len(order) and specs[order[self.next_arrival]].arrival_ns <= self.now:
            i = order[self.next_arrival]
            self.next_arrival += 1
            s = specs[i]
            prompt, hashes = self.workload.prompt(i, self.hasher)
            try:
                validate_generate(Generate(str(i), prompt, s.output_len, ignore_eos=True), self.limits, ())
            except RequestRejected:
                self.num_rejected += 1
                continue
            req = Request(
                str(i), prompt, s.output_len, seq_id=i, ignore_eos=True, block_hasher=self.hasher,
                arrival_time=s.arrival_ns / 1e9, block_hashes=hashes, priority=s.priority,
            )
            self.sched.add_request(req)

    def step(self, out) -> tuple[int, int, bool]:
        """Run one planned step in virtual time: charge it (drafts are scheduled tokens),
        sample a token for every row that completed its tokens, and for a row with drafts
        one more for each draft kept (`num_accepted`), apply them. Returns (the step's ns,
        rows sampled, whether any request finished).

        A plan's external saves add their staging; a plan of external saves or loads alone
        costs only that (it computes nothing); its I/O is queued once it ran."""
        self.num_steps += 1
        plan = out.plan
        for row in plan.new_rows:
            self.admit_ns[row.seq_id] = self.now
        self.stage_ns = stage_ns = 0 if self.external is None else self.external.stage_ns(plan.external)
        if out.scheduled:
            step_ns = self.overhead_ns + self.per_token_ns * out.num_scheduled_tokens + self.load_ns(plan) + stage_ns
        else:
            step_ns = stage_ns
        self.now = now = self.now + step_ns
        if plan.external is not None:
            self.external.ran(self.sched, plan.external, now)
        seq_ids, token_ids = [], []
        token_base = self.token_base
        spec = plan.spec_token_ids
        extra: dict[int, list[int]] = {}
        for req in out.scheduled:
            # NOTE: a row with drafts counts them computed (>=): they are rolled back if rejected.
            if req.num_computed_tokens >= req.num_tokens:
                seq_id = req.seq_id
                token = token_base[seq_id] + req.num_output_tokens
                seq_ids.append(seq_id)
                token_ids.append(token)
                drafts = spec.get(seq_id) if spec else None
                if drafts:
                    m = num_accepted(drafts, token)
                    if m:  # the accepted drafts after the first, then the token after the last
                        extra[seq_id] = list(range(token + 1, token + m + 1))
        outputs = self.sched.update_from_output(StepResult(plan.step_id, seq_ids, token_ids, extra_token_ids=extra))
        first_token_ns = self.first_token_ns
        for r in outputs.requests:
            if first_token_ns[r.seq_id] == NOT_YET:
                first_token_ns[r.seq_id] = now
        for i in outputs.finish_reasons:
            self.finish_ns[outputs.requests[i].seq_id] = now
            self.finished_seq_ids.append(outputs.requests[i].seq_id)
        return step_ns, len(seq_ids), bool(outputs.finish_reasons)

    def load_ns(self, plan) -> int:
        """The host tier's loads of ``plan``: they run before the step's tokens, charged
        by bandwidth (1 GB/s = 1 byte/ns). Stores are not: the worker overlaps them (a
        side stream on CUDA)."""
        if plan.tier_copies is None or not plan.tier_copies.load_device_ids:
            return 0
        loads = len(plan.tier_copies.load_device_ids)
        self.num_loads += loads
        return round(loads * self.block_bytes / self.cfg.offload_bandwidth_gbps)

    def is_repeatable_decode(self, out, num_sampled: int, any_finished: bool, host_evictions: int) -> bool:
        """Whether the step just run may be repeated without scheduling: every running
        request decoded one token, and none was admitted, resumed, preempted or finished."""
        plan = out.plan
        if self.spec_k:
            return False  # speculation: each step draws acceptances (see the module doc)
        if self.external is not None and not (out.scheduled and self.external.allows_fast_forward(self.sched, plan.external)):
            return False
        if any_finished or plan.new_rows or plan.resumed_rows or out.preempted:
            return False
        num_running = len(self.sched.running)
        if out.num_scheduled_tokens != num_running or num_sampled != num_running:
            return False  # not every running request decoded one token
        # NOTE: when the plan's write-through stores evicted from the host tier after the
        # waiting head was tried, it may have lost host hits, and fit next step.
        return self.tier is None or self.tier.num_evictions == host_evictions

    def fast_forward(self, step_ns: int) -> None:
        """Repeat the decode step as long as nothing else would happen (simulator/fastforward.py),
        and no later than the step that starts before the next arrival (or external load's end).
        With an external tier each step of the stretch stages and queues its own saves."""
        external = self.external
        step_ns -= self.stage_ns  # NOTE: the staging was the step's own; the stretch's steps stage theirs
        ends = []
        if self.next_arrival < len(self.order):
            ends.append(self.specs[self.order[self.next_arrival]].arrival_ns)
        elif self.horizon_ns is not None:
            ends.append(self.horizon_ns)
        if external is not None and (t := external.next_event_ns()) is not None:
            ends.append(t)
        if ends:
            gap = min(ends) - self.now
            if gap <= 0:
                return
            if external is None:
                limit = -(-gap // step_ns)  # steps that start before the next arrival
            else:
                limit = external.num_steps_before(gap, step_ns, len(self.sched.running))
        else:
            limit = 1 << 62
        k = decode_horizon(self.sched, limit)
        if k <= 0:
            return
        start, staged = self.now, 0

        def on_external_ops(j: int, ops) -> None:  # step j of the stretch planned ``ops``
            nonlocal staged
            staged += external.stage_ns(ops)
            external.ran(self.sched, ops, start + (j + 1) * step_ns + staged)

        fast_forward_decode(self.sched, k, self.token_base, on_external_ops if external is not None else None)
        self.num_steps += k
        self.num_ff_steps += k
        self.now += k * step_ns + staged
