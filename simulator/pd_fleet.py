"""The P/D fleet what-if: P prefill engines and D decode engines, each the real
Scheduler/KVCacheManager/BlockPool of the offline simulator (simulator/engine.py), as
vllm-router's PD mode runs vLLM engines with the NixlConnector, in one virtual clock.

The engines' schedulers carry the real P/D connector (scheduler/sched/pd_connector.py),
as ``kvpool serve --kv-transfer-config`` builds them: a producer on a prefill engine, a
consumer on a decode engine. A request goes first to a prefill engine (the router's
policy over the P pool) with max_tokens 1 and ``do_remote_decode``: it computes the
prompt and samples one token (discarded), and ends; its scheduler lends its blocks and
answers with ``kv_transfer_params``. The router hands it, with those params, to a decode
engine (the same policy over the D pool, at that time), whose scheduler parks it: its own
prefix-cache hits, then a pull of the rest of the prompt's blocks, the last partial one
too, in every KV-cache group (hybrid groups: the prefill engine lends each sliding group's
in-window tail, the decode engine fills each of its non-null blocks from the block at the
same position of that group, scheduler/sched/pd_remote_blocks.py), timed by the link (simulator/pd_transfer.py: ``transfer_gbps`` plus
``transfer_latency_ms`` a pull); once read it computes the prompt's last token and
decodes the whole output. The prefill engine frees the blocks when the read ends
(``lends_read``). TTFT is the decode engine's first token less the send: the client
streams from the decode engine. Leases never pass: every lend is read.

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

from protocol.kv_transfer_params import parse_kv_transfer_params
from simulator.config import SimConfig
from simulator.engine import EngineRun
from simulator.fleet_requests import routing_units
from simulator.fleet_result import FleetResult
from simulator.pd_engines import Engine, PoolWorkload, pd_connector
from simulator.pd_figures import pd_result
from simulator.pd_transfer import PDTransferLink
from simulator.routers import make_router
from simulator.token_times import TokenTimes
from simulator.workload import Workload

ARRIVAL, RELEASE = 0, 1  # what an engine's inbox holds
REMOTE_DECODE = parse_kv_transfer_params({"do_remote_decode": True})  # the router's prefill leg


class PDFleet:
    """P prefill and D decode engines behind ``router``; see the module doc."""

    def __init__(self, workload: Workload, cfg: SimConfig, num_prefill: int, num_decode: int, router: str = "round_robin",
                 transfer_gbps: float = 2.0, transfer_latency_ms: float = 1.0, max_concurrency: int | None = None, seed: int = 0):
        if cfg.external_tier != "none" or cfg.num_speculative_tokens or router == "kv_aware":
            raise ValueError("a P/D fleet runs without an external tier, speculative decoding or kv_aware")
        if num_prefill < 1 or num_decode < 1 or not 0 < transfer_gbps < math.inf or transfer_latency_ms < 0:
            raise ValueError("a P/D fleet needs P, D >= 1, a positive bandwidth and a latency >= 0")
        workload.reset()
        self.workload, self.cfg, self.max_concurrency = workload, cfg, max_concurrency
        self.transfer = (transfer_gbps, transfer_latency_ms)
        self.prompts: dict[int, tuple[list[int], list]] = {}
        self.prefill_view = PoolWorkload(workload, self.prompts, output_len=1)
        self.decode_view = PoolWorkload(workload, self.prompts)
        self.prefill = [self._engine(self.prefill_view, r, "prefill") for r in range(num_prefill)]
        self.decode = [self._engine(self.decode_view, r, "decode") for r in range(num_decode)]
        self.prefill_at = {e.run.sched.kv_transfer.address: e for e in self.prefill}  # side channel -> prefill engine
        self.prefill_router = make_router(router, num_prefill, seed, cfg.block_size)
        self.decode_router = make_router(router, num_decode, seed, cfg.block_size)
        n = len(workload.specs)
        self.send_ns = [0] * n
        self.routed_to = [(-1, -1)] * n  # (prefill engine, decode engine)
        self.answers: dict[int, dict] = {}  # request -> its prefill engine's kv_transfer_params, until a decode engine takes it
        self.handoffs: list[tuple[int, int]] = []  # heap of (prefill end, request)
        self.all_finishes: list[int] = []  # when clients saw each request end, sorted (the closed loop)
        self.sent = 0
        self.tokens = TokenTimes(n)  # the decode engines' tokens: what the clients see

    def _engine(self, view: PoolWorkload, index: int, pool: str) -> Engine:
        cfg = self.cfg
        if pool == "prefill":
            connector, link = pd_connector("kv_producer", f"sim-prefill-{index}", cfg.block_size, cfg.group_windows), None
            connector.attach(f"sim-prefill-{index}:1")  # NOTE: a fake side channel, the key of the fleet's reads
        else:
            connector = pd_connector("kv_consumer", f"sim-decode-{index}", cfg.block_size, cfg.group_windows)
            # NOTE: a pull reads one block per (group, position) it fills, each one group's bytes.
            link = PDTransferLink(cfg.block_bytes(), *self.transfer)
        run = EngineRun(view, cfg, index if pool == "prefill" else len(self.prefill) + index, kv_transfer=connector)
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
        """Request i's prefill ended at t: the router picks a decode engine, which gets its answer's params."""
        loads = [e.load(t) for e in self.decode]
        prompt, hashes = self.prompts[i]
        d = self.decode_router.route(loads, routing_units(self.workload, i, prompt), hashes, t)
        engine = self.decode[d]
        self._hand(engine, self.decode_view, i, t)
        self.routed_to[i] = (self.routed_to[i][0], d)

    def _hand(self, engine: Engine, view: PoolWorkload, i: int, t: int) -> None:
        view.specs[i] = dataclasses.replace(view.specs[i], arrival_ns=t)
        heapq.heappush(engine.inbox, (t, ARRIVAL, i))
        engine.routed += 1
        engine.routed_tokens += view.specs[i].prompt_len

    def _release(self, address: str, request_id: str, t: int) -> None:
        """The lent blocks of ``request_id`` at ``address`` (a prefill engine's side channel) were read by t."""
        heapq.heappush(self.prefill_at[address].inbox, (t, RELEASE, int(request_id)))

    def _finished(self, engine: Engine, i: int, t: int, client_sees: bool) -> None:
        bisect.insort(engine.finish_times, t)
        if client_sees:
            bisect.insort(self.all_finishes, t)

    # -- an engine's turn ----------------------------------------------------------------
    def _take_inbox(self, engine: Engine) -> bool:
        """What reached the engine by its clock: requests to admit (with their params), lends
        read, pulls done. Whether any pull came back."""
        run, inbox, sched = engine.run, engine.inbox, engine.run.sched
        while inbox and inbox[0][0] <= run.now:
            _, kind, i = heapq.heappop(inbox)
            if kind == ARRIVAL:
                run.order.append(i)
            elif sched.lends_read([str(i)]) != 1:
                raise RuntimeError(f"prefill engine {engine.index}: request {i} read but not lent")
            engine.blocked = False
        first = run.next_arrival
        run.admit_arrivals()
        for i in run.order[first : run.next_arrival]:
            request = sched.requests.get(str(i))
            if request is None:  # rejected: answered at once
                self._finished(engine, i, run.now, True)
            if engine.pool == "prefill":
                if request is None:
                    del self.prompts[i]
                else:
                    request.kv_transfer_params = REMOTE_DECODE
                continue
            del self.prompts[i]  # NOTE: both pools have read it
            answer = self.answers.pop(i)
            if request is None:  # its prefill engine's lend is freed, unread
                self._release(f"{answer['remote_host']}:{answer['remote_port']}", answer["remote_request_id"], run.now)
            else:
                request.kv_transfer_params = parse_kv_transfer_params(answer)
        if engine.link is None or not engine.link.deliver(sched, run.now):
            return False
        engine.blocked = False
        return True

    def _turn(self, engine: Engine, horizon: float) -> None:
        run, sched = engine.run, engine.run.sched
        pulls_back = self._take_inbox(engine)
        out = sched.schedule()
        if out is None:
            engine.blocked = True
            return
        engine.peak_running = max(engine.peak_running, len(sched.running))
        start, seen = run.now, len(run.finished_seq_ids)
        if engine.pool == "prefill":
            run.step(out)
            for r in out.scheduled:
                if r.kv_transfer_answer is not None:  # NOTE: every prefill ends in the step that samples (max_tokens 1)
                    self.answers[r.seq_id] = r.kv_transfer_answer
        else:
            self._decode_step(engine, out, horizon, pulls_back)
        engine.busy_ns += run.now - start
        for i in run.finished_seq_ids[seen:]:
            self._finished(engine, i, run.finish_ns[i], engine.pool == "decode")
            if engine.pool == "prefill":
                heapq.heappush(self.handoffs, (run.finish_ns[i], i))

    def _decode_step(self, engine: Engine, out, horizon: float, pulls_back: bool) -> None:
        """Run a decode engine's step, queue its plan's pulls on the link (each frees its lend
        where it ends), and fast-forward what follows if nothing else can happen before
        ``horizon`` (another party's turn), the engine's next arrival or its next pull's end."""
        run, link = engine.run, engine.link
        step_ns, num_sampled, any_finished = self.tokens.run_step(run, out)
        ops = out.plan.kv_transfer
        pulls = ops is not None and bool(ops.pull_ids)
        if pulls:
            for address, request_id, end in link.queue(ops, run.now):
                self._release(address, request_id, end)
        # NOTE: as after an external tier's loads, no stretch after a step that parked a request (the waiting head
        # changed) or once pulls came back (their requests are admitted next, or wait holding their blocks).
        if not run.cfg.fast_forward or pulls or pulls_back or not run.is_repeatable_decode(out, num_sampled, any_finished, 0):
            return
        pull_end = link.next_event_ns()
        horizon = min(horizon, engine.inbox[0][0] if engine.inbox else math.inf, math.inf if pull_end is None else pull_end)
        run.horizon_ns = None if horizon == math.inf else int(horizon)
        self.tokens.run_fast_forward(run, step_ns)

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
        lent = sum(len(e.run.sched.kv_transfer.lent) for e in self.prefill)
        if lent or self.answers:
            raise RuntimeError(f"{lent} prefill lends never read, {len(self.answers)} answers never taken")
        return pd_result(self, wall_start, cpu_start)


def simulate_pd_fleet(workload: Workload, cfg: SimConfig, num_prefill: int, num_decode: int, router: str = "round_robin",
                      transfer_gbps: float = 2.0, transfer_latency_ms: float = 1.0, max_concurrency: int | None = None,
                      seed: int = 0) -> FleetResult:
    """Replay ``workload`` through ``num_prefill`` prefill and ``num_decode`` decode engines."""
    return PDFleet(workload, cfg, num_prefill, num_decode, router, transfer_gbps, transfer_latency_ms, max_concurrency, seed).run()
