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
the clock jumps to the next arrival or the next load's end. ``external_warm``: the
workload is replayed once to fill the store, and the run measured is a second replay
with everything else fresh (a restart).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.client_messages import Generate
from protocol.kv_cache_spec import DEFAULT_BLOCK_SIZE
from protocol.speculative_config import SpeculativeConfig
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_usage import get_peak_usage
from scheduler.core.offload.offload_tier import HostTier
from scheduler.sched.pd_connector import PDConnector
from scheduler.sched.policy_options import policy_kwargs
from scheduler.sched.priority_scheduler import scheduler_class
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate
from simulator.external_io import EXTERNAL_TIER_SPEEDS, TierSpeeds
from simulator.external_store import SimulatedStore
from simulator.external_worker import SimExternalWorker
from simulator.fastforward import decode_horizon, fast_forward_decode
from simulator.result import NOT_YET, SimResult
from simulator.retention import pin_first_prefix, retention_manager
from simulator.spec_decode import (
    DEFAULT_ACCEPTANCE_RATE,
    AcceptanceDrafter,
    num_accepted,
    spec_figures,
)
from simulator.token_times import percentile
from simulator.workload import OUTPUT_TOKEN_BASE, Workload


@dataclass(frozen=True, slots=True)
class SimConfig:
    num_blocks: int
    block_size: int = DEFAULT_BLOCK_SIZE
    policy: str = "vllm"
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 131072
    step_overhead_ms: float = 5.0
    ms_per_token: float = 0.02
    hash_algo: str = "xxhash"
    fast_forward: bool = True
    # The host tier (scheduler/core/offload/offload_tier.py): slots, when blocks go there
    # ("eviction" or write-through "full"), the bandwidth a load is charged at, and
    # the KV bytes of one token over all layers (bytes moved; the default is a
    # Llama-3-8B in bfloat16: 2 x 32 layers x 8 KV heads x 128 dims x 2 bytes).
    num_host_blocks: int = 0
    offload_store: str = "eviction"
    offload_bandwidth_gbps: float = 25.0
    kv_bytes_per_token: int = 131072
    # vLLM 0.32's scheduler_reserve_full_isl (scheduler/sched/scheduler.py).
    reserve_full_sequence: bool = True
    # vLLM 0.32's scheduling-policy options (scheduler/sched/policy_options.py).
    scheduling_policy: str = "fcfs"
    long_prefill_token_threshold: int = 0
    long_prefill_token_threshold_adaptive: bool = False
    enable_chunked_prefill: bool = True
    watermark: float = 0.0
    max_num_scheduled_tokens: int | None = None  # None: max_num_batched_tokens
    max_num_active_seqs: int | None = None  # None: max_num_seqs
    # The device pool's eviction policy (scheduler/core/retention/eviction_policies.py), as --kv-eviction-policy.
    eviction_policy: str = "lru"
    # Pin the first this many tokens (whole blocks) of the first request to arrive
    # before the replay, as POST /v1/cache/pin would (the server's --max-pinned-fraction cap).
    pin_prefix_tokens: int = 0
    max_pinned_fraction: float = 0.5
    # Hybrid KV-cache groups' windows (simulator/layer_windows.py); (): one full-attention group.
    group_windows: tuple[int, ...] = ()
    # Speculative decoding (simulator/spec_decode.py): drafts a decoding step (0: off),
    # each accepted with this probability until the first rejection, drawn from this seed.
    num_speculative_tokens: int = 0
    spec_acceptance_rate: float = DEFAULT_ACCEPTANCE_RATE
    spec_seed: int = 0
    # The external tier (simulator/external_io.py): "none", "disk" or "store"; its capacity in
    # blocks (0: unbounded); read and write GB/s and per-load latency (None: the tier's
    # defaults, EXTERNAL_TIER_SPEEDS); replay once to fill it before the measured replay.
    external_tier: str = "none"
    external_tier_blocks: int = 0
    external_read_gbps: float | None = None
    external_write_gbps: float | None = None
    external_latency_ms: float | None = None
    external_warm: bool = False

    def external_speeds(self) -> TierSpeeds:
        """The external tier's speeds: those given, the tier's defaults for the others."""
        d = EXTERNAL_TIER_SPEEDS[self.external_tier]
        pick = lambda given, default: default if given is None else given  # noqa: E731
        return TierSpeeds(pick(self.external_read_gbps, d.read_gbps), pick(self.external_write_gbps, d.write_gbps),
                          pick(self.external_latency_ms, d.latency_ms))


def simulate(workload: Workload, cfg: SimConfig, on_end: Callable[[Scheduler], None] | None = None) -> SimResult:
    """Replay ``workload`` through a fresh scheduler and pool; see the module doc.
    ``on_end`` (tests) sees the scheduler once the run is over."""
    wall_start = time.perf_counter()
    workload.reset()
    store = None if cfg.external_tier == "none" else SimulatedStore(cfg.external_tier_blocks)
    if store is not None and cfg.external_warm:
        EngineRun(workload, cfg, store=store).run()  # NOTE: its queued saves are in the store already (a drained shutdown)
        workload.reset()
    run = EngineRun(workload, cfg, store=store)
    run.run()
    if on_end is not None:
        on_end(run.sched)
    return run.result(wall_start)


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
        self.block_bytes = cfg.kv_bytes_per_token * bs
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

    def result(self, wall_start: float) -> SimResult:
        """The run's figures, ``wall_s`` counted from ``wall_start``."""
        kv, tier, specs, n, external = self.kv, self.tier, self.specs, self.n, self.external
        stats, ext = kv.prefix_cache_stats, kv.external_prefix_cache_stats
        # NOTE: the manager counts the host tier's hits and the external tier's together (as vLLM's connector stats).
        external_hits = external.num_hit_tokens if external is not None else 0
        if tier is not None:
            host_hits, stores, loads, skipped = ext.hits - external_hits, tier.num_stores, tier.num_loads, tier.num_stores_skipped
        else:
            host_hits = stores = loads = skipped = 0
        delays = [self.admit_ns[i] - specs[i].arrival_ns for i in range(n) if self.admit_ns[i] != NOT_YET]
        ttfts = [self.first_token_ns[i] - specs[i].arrival_ns for i in range(n) if self.first_token_ns[i] != NOT_YET]
        block_bytes, gbps = self.block_bytes, self.cfg.offload_bandwidth_gbps
        return SimResult(
            num_blocks=self.cfg.num_blocks,
            policy=self.cfg.policy,
            eviction_policy=self.cfg.eviction_policy,
            num_pinned_blocks=kv.pinned.num_pinned_blocks,
            prefix_cache_hit_rate=stats.hit_rate,
            prefix_cache_queries=stats.queries,
            prefix_cache_hits=stats.hits,
            prefix_cache_preempted_hit_rate=stats.preempted_hit_rate,
            prefix_cache_preempted_queries=stats.preempted_queries,
            prefix_cache_preempted_hits=stats.preempted_hits,
            num_evictions=kv.block_pool.num_evictions,
            num_preemptions=self.sched.num_preemptions,
            num_rejected=self.num_rejected,
            num_requests=n,
            num_finished=sum(1 for t in self.finish_ns if t != NOT_YET),
            peak_usage=get_peak_usage(kv),
            mean_queueing_delay_ms=sum(delays) / len(delays) / 1e6 if delays else 0.0,
            p99_queueing_delay_ms=percentile(delays, 0.99) / 1e6,
            mean_ttft_ms=sum(ttfts) / len(ttfts) / 1e6 if ttfts else 0.0,
            simulated_s=self.now / 1e9,
            num_steps=self.num_steps,
            num_fast_forwarded_steps=self.num_ff_steps,
            wall_s=time.perf_counter() - wall_start,
            num_host_blocks=self.cfg.num_host_blocks,
            host_hit_rate=host_hits / stats.queries if stats.queries else 0.0,
            combined_hit_rate=(stats.hits + host_hits + external_hits) / stats.queries if stats.queries else 0.0,
            external_prefix_cache_hit_rate=ext.hit_rate if tier is not None or external is not None else 0.0,
            external_prefix_cache_queries=ext.queries if tier is not None or external is not None else 0,
            external_prefix_cache_hits=host_hits + external_hits,
            num_host_stores=stores,
            num_host_loads=loads,
            num_host_stores_skipped=skipped,
            num_host_evictions=tier.num_evictions if tier is not None else 0,
            bytes_stored=stores * block_bytes,
            bytes_loaded=loads * block_bytes,
            load_time_s=self.num_loads * block_bytes / gbps / 1e9,
            **spec_figures(self.spec_k, self.sched.spec_stats),
            **({} if external is None else external.figures(self.now, stats.queries)),
            external_tier_warm=external is not None and self.cfg.external_warm,
            admit_ns=self.admit_ns,
            first_token_ns=self.first_token_ns,
            finish_ns=self.finish_ns,
        )
