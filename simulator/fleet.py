"""The fleet what-if: N replicas, each the real Scheduler/KVCacheManager/BlockPool of
the offline simulator (simulator/engine.py), behind one of vllm-router's policies
(simulator/routers.py), in one virtual clock.

Requests are handed out in arrival order. Before the router decides on a request
arriving at t, every replica runs the steps that start before t; the router then
sees what it would see at t: each replica's load (requests routed to it that had not
finished by t, a rejection finishing at once) and, for kv_aware, the KV events of
the steps that had ended by t (a step's events are published at its end, as the
engine core publishes them after the step) and each replica's tokens still being
prefilled: a request's, from its routing until its first token (``stream``, what
the load generator does) or until it finishes (a client that does not stream). A
replica with nothing to run jumps to the arrival. Fast-forwarded decode stretches (simulator/fastforward.py) end before the
next arrival anywhere, so no replica ever runs past a request it could be given.

A request's times outside the engines (``--request-path-ms``, none by default:
simulator/fleet_requests.py's `RequestPaths`): the router's loads and prefilling counts
are what it has seen by its decision.

``--max-concurrency C`` is the load generator's closed loop: a request is sent at its
arrival time or, when C are in flight, when the client sees the end of the one that
frees a slot. That finish is found by stepping the replica whose clock is earliest
until every finish before the candidate send time is known.

One replica behind any router is the single-engine simulator, counter for counter.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import time

from protocol.kv_cache_spec import is_hybrid
from scheduler.core.kv_events import KVEventRecorder
from simulator.config import SimConfig
from simulator.engine import EngineRun
from simulator.fleet_requests import PreparedWorkload, RequestPaths, routing_units
from simulator.fleet_result import FleetResult
from simulator.result import NOT_YET
from simulator.routers import make_router
from simulator.spec_decode import spec_figures
from simulator.token_times import TokenTimes, percentile
from simulator.workload import Workload


class Fleet:
    """N replica runs, a router, the clock of sends; see the module doc."""

    def __init__(self, workload: Workload, cfg: SimConfig, replicas: int, router: str,
                 max_concurrency: int | None = None, seed: int = 0, stream: bool = True,
                 paths: RequestPaths | None = None):
        if cfg.external_tier != "none" or (router == "kv_aware" and is_hybrid(cfg.group_windows)):
            # NOTE: kv_aware's index holds a hash per replica, not per KV-cache group.
            raise ValueError("a fleet's replicas have no external tier (one engine only), nor kv_aware with hybrid groups")
        workload.reset()
        self.workload = workload
        self.prepared = PreparedWorkload(workload)
        self.cfg = cfg
        self.router = make_router(router, replicas, seed, cfg.block_size)
        self.max_concurrency = max_concurrency
        self.stream = stream
        self.path_ns = (paths or RequestPaths()).draw(len(workload.specs))  # per request: (decide, there, back)
        self.runs: list[EngineRun] = []
        self.recorders: list[KVEventRecorder] = []
        for r in range(replicas):
            run = EngineRun(self.prepared, cfg, r)
            run.specs = self.prepared.specs
            run.order = []
            if router == "kv_aware":
                recorder = KVEventRecorder()
                run.kv.block_pool.event_sink = recorder
                self.recorders.append(recorder)
            self.runs.append(run)
        n = len(workload.specs)
        self.routed_to = [-1] * n
        self.routed: list[int] = [0] * replicas
        self.routed_tokens: list[int] = [0] * replicas
        # Per replica: finish times in order, and (time, events) not yet read by the router.
        self.finish_times: list[list[int]] = [[] for _ in range(replicas)]
        self.pending_events: list[list[tuple[int, list]]] = [[] for _ in range(replicas)]
        self.all_finishes: list[int] = []  # sorted, for the closed loop
        self.sent = 0
        # kv_aware: per replica, (request, tokens it prefills) routed and still prefilling
        # as far as the router knows; the time each rejected request was answered.
        self.prefilling: list[list[tuple[int, int]]] = [[] for _ in range(replicas)]
        self.rejected_ns: dict[int, int] = {}
        self.tokens = TokenTimes(n)  # for the latency figures

    # -- one replica -------------------------------------------------------------
    def _record(self, r: int, run: EngineRun, seen_finished: int) -> None:
        for seq_id in run.finished_seq_ids[seen_finished:]:
            self._finish(r, seq_id, run.finish_ns[seq_id])
        if self.recorders:
            events = self.recorders[r].take_events()
            if events:
                self.pending_events[r].append((run.now, events))

    def _finish(self, r: int, i: int, t: int) -> None:
        """Request i of replica r ended in the engine at t: its answer reaches the
        router and the client its way back later."""
        t += self.path_ns[i][2]
        self.finish_times[r].append(t)
        bisect.insort(self.all_finishes, t)

    def _admit(self, r: int, run: EngineRun) -> None:
        first = run.next_arrival
        run.admit_arrivals()
        for i in run.order[first : run.next_arrival]:
            if str(i) not in run.sched.requests:  # rejected: the server answers at once
                self._finish(r, i, run.now)
                self.rejected_ns[i] = run.now

    def _step(self, r: int, run: EngineRun) -> bool:
        """Admit what has arrived, run one step (and any fast-forward after it).
        False when the replica has nothing to run."""
        self._admit(r, run)
        while not run.sched.has_unfinished_requests():
            # Idle: on to the next request on its way here, if it comes before the horizon.
            if run.next_arrival == len(run.order):
                return False
            arrival = self.prepared.specs[run.order[run.next_arrival]].arrival_ns
            if run.horizon_ns is not None and arrival >= run.horizon_ns:
                return False
            run.now = max(run.now, arrival)
            self._admit(r, run)
        seen = len(run.finished_seq_ids)
        host_evictions = run.tier.num_evictions if run.tier is not None else 0
        out = run.sched.schedule()
        if out is None:
            self._record(r, run, seen)
            return False
        step_ns, num_sampled, any_finished = self.tokens.run_step(run, out)
        if run.cfg.fast_forward and run.is_repeatable_decode(out, num_sampled, any_finished, host_evictions):
            self.tokens.run_fast_forward(run, step_ns)
        self._record(r, run, seen)
        return True

    def _advance(self, r: int, t: int | None) -> None:
        """Run replica r's steps that start before t (None: all of them)."""
        run = self.runs[r]
        run.horizon_ns = t
        while t is None or run.now < t:
            if not self._step(r, run):
                return

    # -- the router's view ----------------------------------------------------------
    def _loads(self, t: int) -> list[int]:
        return [self.routed[r] - bisect.bisect_right(self.finish_times[r], t) for r in range(len(self.runs))]

    def _prefilling(self, t: int) -> list[int]:
        """Each replica's tokens of routed requests the router still counts as
        prefilling at t: no first token (or, not streamed, no finish) by t."""
        out, paths = [], self.path_ns
        for r, held in enumerate(self.prefilling):
            run = self.runs[r]
            ends = run.first_token_ns if self.stream else run.finish_ns
            # NOTE: seen once back: what the engine had sent by t less its way back.
            held[:] = [(i, n) for i, n in held
                       if not (ends[i] != NOT_YET and ends[i] + paths[i][2] <= t
                               or self.rejected_ns.get(i, t + 1) + paths[i][2] <= t)]
            out.append(sum(n for _, n in held))
        return out

    def _deliver_events(self, t: int) -> None:
        index = self.router.index
        for r, pending in enumerate(self.pending_events):
            k = 0
            while k < len(pending) and pending[k][0] <= t:
                index.apply(r, pending[k][1])
                k += 1
            if k:
                del pending[:k]

    def _clock(self, run: EngineRun) -> int:
        """When the replica next does anything: now, or when idle, the arrival of the
        next request on its way to it."""
        if run.sched.has_unfinished_requests() or run.next_arrival == len(run.order):
            return run.now
        return max(run.now, self.prepared.specs[run.order[run.next_arrival]].arrival_ns)

    def _send_time(self, t: int) -> int:
        """When the next request goes out: its arrival time t, or under the closed loop
        the finish that frees a slot."""
        c = self.max_concurrency
        if c is None:
            return t
        while True:
            need = self.sent - c + 1  # finishes needed by the send time
            if need <= 0:
                return t
            clocks = {r: self._clock(run) for r, run in enumerate(self.runs)
                      if run.sched.has_unfinished_requests() or run.next_arrival < len(run.order)}
            known_until = min(clocks.values(), default=math.inf)
            if len(self.all_finishes) >= need and self.all_finishes[need - 1] <= known_until:
                return max(t, self.all_finishes[need - 1])
            if not clocks:
                raise RuntimeError("closed loop stuck: slots taken but nothing running")
            r = min(clocks, key=clocks.__getitem__)
            run = self.runs[r]
            # NOTE: the next send follows a finish: this replica's come after any
            # fast-forward, the others' after their clocks.
            others = [c for i, c in clocks.items() if i != r]
            run.horizon_ns = max(t, min(others)) if others else None
            run.now = clocks[r]  # an idle replica waits for the request on its way
            if not self._step(r, run) and run.sched.has_unfinished_requests():
                raise RuntimeError(f"replica {r} stuck: requests left but nothing can be scheduled")

    def run(self) -> FleetResult:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        specs = self.prepared.specs
        order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_ns)
        decided = 0
        for i in order:
            decide_ns, there_ns, _ = self.path_ns[i]
            # NOTE: decisions in the order of sends, so no replica has run past one.
            t = decided = max(decided, self._send_time(specs[i].arrival_ns) + decide_ns)
            for r in range(len(self.runs)):
                self._advance(r, t)
            r = self._route(i, t)
            if t + there_ns != specs[i].arrival_ns:  # the engine has it when it gets there
                specs[i] = dataclasses.replace(specs[i], arrival_ns=t + there_ns)
            run = self.runs[r]
            run.now = max(run.now, t)  # behind t only when it had nothing to run
            run.order.append(i)
            self.sent += 1
        for r in range(len(self.runs)):
            self._advance(r, None)
            if self.runs[r].sched.has_unfinished_requests():
                raise RuntimeError(f"replica {r} stuck: requests left but nothing can be scheduled")
        return self._result(wall_start, cpu_start)

    def _route(self, i: int, t: int) -> int:
        run0 = self.runs[0]
        prompt, hashes = self.prepared.build(i, run0.hasher)
        if self.recorders:
            self._deliver_events(t)
        if self.router.name == "kv_aware":
            r, new_tokens = self.router.choose(len(prompt), hashes, self._loads(t), self._prefilling(t))
            self.prefilling[r].append((i, new_tokens))
        else:
            r = self.router.route(self._loads(t), routing_units(self.workload, i, prompt), hashes, t)
        self.routed_to[i] = r
        self.routed[r] += 1
        self.routed_tokens[r] += self.prepared.specs[i].prompt_len
        return r

    def _result(self, wall_start: float, cpu_start: float) -> FleetResult:
        specs, n = self.prepared.specs, len(self.prepared.specs)
        per, hits, queries, delays, ttfts = [], 0, 0, [], []
        for r, run in enumerate(self.runs):
            stats = run.kv.prefix_cache_stats
            hits += stats.hits
            queries += stats.queries
            mine = [i for i in range(n) if self.routed_to[i] == r]
            d = [run.admit_ns[i] - specs[i].arrival_ns for i in mine if run.admit_ns[i] != NOT_YET]
            delays += d
            ttfts += [run.first_token_ns[i] - specs[i].arrival_ns for i in mine if run.first_token_ns[i] != NOT_YET]
            per.append({"replica": r, "requests": self.routed[r], "prompt_tokens": self.routed_tokens[r],
                        "hit_rate": stats.hit_rate, "prefix_cache_hits": stats.hits, "prefix_cache_queries": stats.queries,
                        "evictions": run.kv.block_pool.num_evictions, "preemptions": run.sched.num_preemptions,
                        "rejected": run.num_rejected, "mean_queueing_delay_ms": sum(d) / len(d) / 1e6 if d else 0.0})

        def imbalance(values: list[int]) -> float:
            mean = sum(values) / len(values)
            return max(values) / mean if mean else 1.0

        decisions = dict(getattr(self.router, "decisions", {}))
        tree = getattr(self.router, "tree", None)
        if tree is not None:  # how close the router's tree came to its size-bound eviction
            decisions["tree_tokens_max"] = max(tree.tenant_size.values(), default=0)
        return FleetResult(
            replicas=len(self.runs), router=self.router.name, num_blocks=self.cfg.num_blocks, policy=self.cfg.policy,
            max_concurrency=self.max_concurrency, aggregate_hit_rate=hits / queries if queries else 0.0,
            prefix_cache_queries=queries, prefix_cache_hits=hits,
            requests_imbalance=imbalance(self.routed), tokens_imbalance=imbalance(self.routed_tokens),
            mean_queueing_delay_ms=sum(delays) / len(delays) / 1e6 if delays else 0.0,
            p50_queueing_delay_ms=percentile(delays, 0.5) / 1e6, p90_queueing_delay_ms=percentile(delays, 0.9) / 1e6,
            p99_queueing_delay_ms=percentile(delays, 0.99) / 1e6,
            mean_ttft_ms=sum(ttfts) / len(ttfts) / 1e6 if ttfts else 0.0,
            num_requests=n, num_finished=sum(len(run.finished_seq_ids) for run in self.runs),
            num_rejected=sum(run.num_rejected for run in self.runs),
            num_evictions=sum(run.kv.block_pool.num_evictions for run in self.runs),
            num_preemptions=sum(run.sched.num_preemptions for run in self.runs),
            simulated_s=max(run.now for run in self.runs) / 1e9, wall_s=time.perf_counter() - wall_start,
            cpu_s=time.process_time() - cpu_start,
            per_replica=per, router_decisions=decisions,
            spec_decode=spec_figures(self.cfg.num_speculative_tokens, *(run.sched.spec_stats for run in self.runs)),
            **self.tokens.figures([s.arrival_ns for s in specs]),
        )


def simulate_fleet(workload: Workload, cfg: SimConfig, replicas: int, router: str,
                   max_concurrency: int | None = None, seed: int = 0, stream: bool = True,
                   paths: RequestPaths | None = None) -> FleetResult:
    """Replay ``workload`` through ``replicas`` fresh engines behind ``router``;
    ``stream``: the clients stream (kv_aware's view of prefilling, see `Fleet`);
    ``paths``: a request's times outside the engines (none by default)."""
    return Fleet(workload, cfg, replicas, router, max_concurrency, seed, stream, paths).run()
