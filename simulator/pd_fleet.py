"""The P/D fleet what-if: P prefill engines and D decode engines, each the real
Scheduler/KVCacheManager/BlockPool of the offline simulator (simulator/engine.py), as
vllm-router's PD mode runs vLLM engines with the NixlConnector, in one virtual clock.

A request goes first to a prefill engine (the router's policy over the P pool) with
max_tokens 1: it computes the prompt and samples one token (discarded), and ends. Its
blocks stay held (vLLM's delayed free) until a decode engine has read them. When it ends,
the router hands it to a decode engine (the same policy over the D pool, at that time),
which admits it through its scheduler's own parking (simulator/pd_transfer.py): its own
prefix-cache hits, then the rest of the prompt read over the link at
``transfer_gbps`` plus ``transfer_latency_ms`` a read; then it computes what is left of
the prompt and decodes the whole output. The prefill engine frees the blocks when the
read ends (or, when the decode engine hit them all and read nothing, when it admits the
request). TTFT is the decode engine's first token less the send: the client streams
from the decode engine.

Time: every party acts at its own time and the earliest goes first: the client's sends
(arrival times, or under ``max_concurrency`` the finish that frees a slot), the router's
hand-overs, the decode engines, the prefill engines, in that order on a tie (so what one
makes at t reaches the next before it acts at t). An engine runs one step (or a
fast-forwarded decode stretch, ending before the earliest time another party acts);
what reaches it during a step is seen at its next step, as in the single-engine run.
"""

from __future__ import annotations

import bisect
import dataclasses
import heapq
import math
import time
from dataclasses import dataclass, field

from simulator.engine import SimConfig, _Run
from simulator.fleet import routing_units
from simulator.fleet_result import FleetResult
from simulator.pd_figures import pd_result
from simulator.pd_transfer import PDTransferLink
from simulator.routers import make_router
from simulator.token_times import TokenTimes
from simulator.workload import Workload

ARRIVAL, RELEASE = 0, 1  # what an engine's inbox holds


class _PoolWorkload(Workload):
    """One pool's view of the workload: its own specs (arrivals rewritten when handed to
    it; a prefill engine's output is 1 token) and each prompt, built once when sent."""

    def __init__(self, inner: Workload, prompts: dict, output_len: int | None = None):
        self.specs = [s if output_len is None else dataclasses.replace(s, output_len=output_len) for s in inner.specs]
        self.output_token_base = inner.output_token_base
        self.prompts = prompts  # shared by the pools: index -> (prompt, block hashes)

    def prompt(self, index: int, hasher):
        prompt, hashes = self.prompts[index]
        return list(prompt), list(hashes)  # NOTE: a Request appends to its own lists


@dataclass(eq=False)
class _Held:
    """A finished prefill request's block table, held for its decode engine (as KVCacheManager.free takes it)."""

    request_id: str
    alloc_noop_until: int = 0


@dataclass(eq=False)
class Engine:
    """One engine of a pool: its run, what reaches it (a heap of (time, kind, request)),
    its link (a decode engine's), and its counts."""

    run: _Run
    pool: str
    index: int  # in its pool
    link: PDTransferLink | None = None
    inbox: list = field(default_factory=list)
    blocked: bool = False  # nothing to schedule until something reaches it
    finish_times: list = field(default_factory=list)
    routed: int = 0
    routed_tokens: int = 0
    busy_ns: int = 0
    peak_running: int = 0

    def wake(self) -> float:
        """When it next acts (inf: not until something reaches it)."""
        run, times = self.run, []
        if self.inbox:
            times.append(self.inbox[0][0])
        if self.link is not None and (t := self.link.next_event_ns()) is not None:
            times.append(t)
        if run.sched.has_unfinished_requests() and not self.blocked:
            times.append(run.now)
        return max(run.now, min(times)) if times else math.inf

    def load(self, t: int) -> int:
        return self.routed - bisect.bisect_right(self.finish_times, t)


class PDFleet:
    """P prefill and D decode engines behind ``router``; see the module doc."""

    def __init__(self, workload: Workload, cfg: SimConfig, num_prefill: int, num_decode: int, router: str = "round_robin",
                 transfer_gbps: float = 2.0, transfer_latency_ms: float = 1.0, max_concurrency: int | None = None, seed: int = 0):  # fmt: skip
        if cfg.external_tier != "none" or cfg.group_windows or cfg.num_speculative_tokens or router == "kv_aware":
            raise ValueError("a P/D fleet runs without an external tier, hybrid groups, speculative decoding or kv_aware")
        if num_prefill < 1 or num_decode < 1 or not 0 < transfer_gbps < math.inf or transfer_latency_ms < 0:
            raise ValueError("a P/D fleet needs P, D >= 1, a positive bandwidth and a latency >= 0")
        workload.reset()
        self.workload, self.cfg, self.max_concurrency = workload, cfg, max_concurrency
        self.transfer = (transfer_gbps, transfer_latency_ms)
        self.prompts: dict[int, tuple[list[int], list]] = {}
        self.prefill_view = _PoolWorkload(workload, self.prompts, output_len=1)
        self.decode_view = _PoolWorkload(workload, self.prompts)
        self.prefill = [self._engine(self.prefill_view, r, "prefill") for r in range(num_prefill)]
        self.decode = [self._engine(self.decode_view, r, "decode") for r in range(num_decode)]
        self.prefill_router = make_router(router, num_prefill, seed, cfg.block_size)
        self.decode_router = make_router(router, num_decode, seed, cfg.block_size)
        n = len(workload.specs)
        self.send_ns = [0] * n
        self.routed_to = [(-1, -1)] * n  # (prefill engine, decode engine)
        self.held: dict[int, tuple[int, _Held]] = {}  # request -> (prefill engine, its held table)
        self.handoffs: list[tuple[int, int]] = []  # heap of (prefill end, request)
        self.all_finishes: list[int] = []  # when clients saw each request end, sorted (the closed loop)
        self.sent = 0
        self.tokens = TokenTimes(n)  # the decode engines' tokens: what the clients see

    def _engine(self, view: _PoolWorkload, index: int, pool: str) -> Engine:
        cfg = self.cfg
        link = None
        if pool == "decode":
            link = PDTransferLink(cfg.block_size, cfg.kv_bytes_per_token * cfg.block_size, *self.transfer)
        run = _Run(view, cfg, index if pool == "prefill" else len(self.prefill) + index, external=link)
        run.specs, run.order = view.specs, []
        return Engine(run, pool, index, link)

    # -- the parties ---------------------------------------------------------------------
    def _send_wake(self, order: list[int]) -> float:
        if self.sent == len(order):
            return math.inf
        t = self.workload.specs[order[self.sent]].arrival_ns
        need = self.sent - (self.max_concurrency or math.inf) + 1  # finishes the send waits for
        if need <= 0:
            return t
        return max(t, self.all_finishes[need - 1]) if len(self.all_finishes) >= need else math.inf

    def _send(self, i: int, t: int) -> None:
        """The client sends request i at t; the router picks a prefill engine."""
        self.send_ns[i] = t
        run0 = self.prefill[0].run
        prompt, hashes = self.workload.prompt(i, run0.hasher)
        self.prompts[i] = (prompt, run0.hasher.block_hashes(prompt) if hashes is None else hashes)
        loads = [e.load(t) for e in self.prefill]
        p = self.prefill_router.route(loads, routing_units(self.workload, i, prompt), self.prompts[i][1], t)
        self._hand(self.prefill[p], self.prefill_view, i, t)
        self.routed_to[i] = (p, -1)
        self.sent += 1

    def _hand_over(self, i: int, t: int) -> None:
        """Request i's prefill ended at t: the router picks a decode engine, which expects its blocks."""
        loads = [e.load(t) for e in self.decode]
        prompt, hashes = self.prompts[i]
        d = self.decode_router.route(loads, routing_units(self.workload, i, prompt), hashes, t)
        engine = self.decode[d]
        engine.link.expect(i, hashes[: len(prompt) // self.cfg.block_size])
        self._hand(engine, self.decode_view, i, t)
        self.routed_to[i] = (self.routed_to[i][0], d)

    def _hand(self, engine: Engine, view: _PoolWorkload, i: int, t: int) -> None:
        view.specs[i] = dataclasses.replace(view.specs[i], arrival_ns=t)
        heapq.heappush(engine.inbox, (t, ARRIVAL, i))
        engine.routed += 1
        engine.routed_tokens += view.specs[i].prompt_len

    def _release(self, i: int, t: int) -> None:
        """Request i's prefill engine may free its blocks at t."""
        p, _ = self.held[i]
        heapq.heappush(self.prefill[p].inbox, (t, RELEASE, i))

    def _finished(self, engine: Engine, i: int, t: int, client_sees: bool) -> None:
        bisect.insort(engine.finish_times, t)
        if client_sees:
            bisect.insort(self.all_finishes, t)

    # -- an engine's turn ----------------------------------------------------------------
    def _take_inbox(self, engine: Engine) -> None:
        """What reached the engine by its clock: requests to admit, tables to free."""
        run, inbox = engine.run, engine.inbox
        while inbox and inbox[0][0] <= run.now:
            _, kind, i = heapq.heappop(inbox)
            if kind == ARRIVAL:
                run.order.append(i)
            else:
                run.kv.free(self.held.pop(i)[1])
            engine.blocked = False
        first = run.next_arrival
        run.admit_arrivals()
        for i in run.order[first : run.next_arrival]:
            rejected = str(i) not in run.sched.requests
            if rejected:  # answered at once; a decode engine's frees its prefill engine's blocks
                self._finished(engine, i, run.now, True)
            if engine.pool == "decode":
                del self.prompts[i]  # NOTE: both pools have read it
                if rejected:
                    engine.link.forget(i)
                    self._release(i, run.now)
            elif rejected:
                del self.prompts[i]
        if engine.link is not None:
            returned = engine.link.next_event_ns()
            engine.link.deliver(run.sched, run.now)
            if returned is not None and returned <= run.now:
                engine.blocked = False

    def _turn(self, engine: Engine, horizon: float) -> None:
        run, sched = engine.run, engine.run.sched
        self._take_inbox(engine)
        out = sched.schedule()
        if out is None:
            engine.blocked = True
            return
        engine.peak_running = max(engine.peak_running, len(sched.running))
        start, seen = run.now, len(run.finished_seq_ids)
        if engine.pool == "prefill":
            self._hold_tables(engine, out)
            run.step(out)
        else:
            if engine.inbox:
                horizon = min(horizon, engine.inbox[0][0])
            run.horizon_ns = None if horizon == math.inf else int(horizon)
            step_ns, num_sampled, any_finished = self.tokens.run_step(run, out)
            for row in out.plan.new_rows:
                if engine.link.forget(row.seq_id):  # all its prompt hit here: nothing read
                    self._release(row.seq_id, start)
            for i, end in engine.link.take_started():
                self._release(i, end)
            if run.cfg.fast_forward and run.is_repeatable_decode(out, num_sampled, any_finished, 0):
                self.tokens.run_fast_forward(run, step_ns)
        engine.busy_ns += run.now - start
        for i in run.finished_seq_ids[seen:]:
            self._finished(engine, i, run.finish_ns[i], engine.pool == "decode")
            if engine.pool == "prefill":
                heapq.heappush(self.handoffs, (run.finish_ns[i], i))

    def _hold_tables(self, engine: Engine, out) -> None:
        """Every prefill row sampling this step ends in it (max_tokens 1): its table moves to
        a holder first, so the scheduler's free leaves it (vLLM's delayed free), and the
        manager still counts the holder's blocks as a request's (its invariants hold)."""
        kv = engine.run.kv
        for r in out.scheduled:
            if r.num_computed_tokens >= r.num_tokens:
                holder = _Held(f"{r.request_id}/held")
                kv.req_to_blocks[holder.request_id] = kv.req_to_blocks.pop(r.request_id)
                kv.num_cached_block[holder.request_id] = kv.num_cached_block.pop(r.request_id, 0)
                self.held[r.seq_id] = (engine.index, holder)

    # -- the run -------------------------------------------------------------------------
    def run(self) -> FleetResult:
        wall_start, cpu_start = time.perf_counter(), time.process_time()
        specs = self.workload.specs
        order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_ns)
        engines = [*self.decode, *self.prefill]  # NOTE: the order of turns on a tie, after sends and hand-overs
        while True:
            wakes = [e.wake() for e in engines]
            parties = [self._send_wake(order), self.handoffs[0][0] if self.handoffs else math.inf, *wakes]
            k = min(range(len(parties)), key=parties.__getitem__)
            t = parties[k]
            if t == math.inf:
                break
            if k == 0:
                self._send(order[self.sent], int(t))
            elif k == 1:
                _, i = heapq.heappop(self.handoffs)
                self._hand_over(i, int(t))
            else:
                engine = engines[k - 2]
                engine.run.now = int(t)
                self._turn(engine, min(parties[:k] + parties[k + 1 :]))
        for e in engines:
            if e.run.sched.has_unfinished_requests():
                raise RuntimeError(f"{e.pool} engine {e.index} stuck: requests left but nothing can be scheduled")
        if self.held:
            raise RuntimeError(f"{len(self.held)} prefill tables never released")
        return pd_result(self, wall_start, cpu_start)


def simulate_pd_fleet(workload: Workload, cfg: SimConfig, num_prefill: int, num_decode: int, router: str = "round_robin",
                      transfer_gbps: float = 2.0, transfer_latency_ms: float = 1.0, max_concurrency: int | None = None,
                      seed: int = 0) -> FleetResult:  # fmt: skip
    """Replay ``workload`` through ``num_prefill`` prefill and ``num_decode`` decode engines."""
    return PDFleet(workload, cfg, num_prefill, num_decode, router, transfer_gbps, transfer_latency_ms, max_concurrency, seed).run()
