"""The worker's process loop: handshake with the scheduler, then execute plans.

A plain blocking ZeroMQ DEALER with poll timeouts. Every message is one frame (a
msgspec msgpack message; the scheduler's ROUTER sees ``[identity, frame]``).

* The KV cache is allocated before any of this (``worker.startup``): a hello
  promises only memory the worker holds.
* Connect, send WorkerHello, wait for WorkerReady; use the number of blocks the
  scheduler chose (at most ours) with no rows, and acknowledge with a Heartbeat
  (the scheduler is ready only once it hears it). A Shutdown instead is a
  refusal: exit 4 (EXIT_REFUSED), so that a supervisor tries again. No WorkerReady
  within ``scheduler_timeout_s``: the scheduler is unreachable, as below.
* Then answer each StepPlan with a StepResult (or a WorkerError, state unchanged);
  Shutdown exits 0. Incoming heartbeats only prove the scheduler is alive: they are
  not answered (two sides that answer each other's heartbeats would ping-pong);
  instead the worker sends its own whenever it has sent nothing for a heartbeat
  interval.
* Silence from the scheduler for ``scheduler_timeout_s``: exit 3, or with
  ``reconnect`` drop every row and handshake again.
* SIGTERM (``WorkerStopping``, raised by the handler ``worker.startup`` installs):
  tell the scheduler with WorkerExit and exit 0.
"""

from __future__ import annotations

import logging
import math
import os
import time

import torch
import zmq

from protocol.codec import Codec, ProtocolError
from protocol.curve import apply_client
from protocol.worker_messages import (
    CompileGrammars,
    ExternalKVDone,
    GrammarsReady,
    Heartbeat,
    KVTransferDone,
    SampledLogprobs,
    SchedulerToWorker,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerExit,
    WorkerHello,
    WorkerReady,
)
from worker.config import WorkerConfig
from worker.external.external_io import ExternalIO
from worker.external.plan_ops import after_step, before_step, hello_fields
from worker.grammar_compiler import GrammarCompiler
from worker.host_load import HostLoad
from worker.host_peers import HostPeers, default_directory
from worker.kv_cache import first_blocks
from worker.metrics import WorkerMetrics
from worker.serving_model import ServingModel
from worker.step.group_tables import hello_group_windows
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner
from worker.threads import StepThreads, projection_weights, wide_num_threads, wide_step_tokens
from worker.transfer import plan_ops as transfer_ops
from worker.transfer.kv_transfer import KVTransfer

log = logging.getLogger("worker")

EXIT_SCHEDULER_LOST = 3
EXIT_REFUSED = 4
# How often the loop looks for finished grammar compiles while any is in flight.
GRAMMAR_POLL_S = 0.002


class SchedulerLost(Exception):
    """No message from the scheduler within the timeout."""


class Refused(Exception):
    """The scheduler answered the hello with Shutdown: the reason."""


class WorkerStopping(Exception):
    """SIGTERM: stop cleanly."""


class WorkerProcess:
    def __init__(
        self, config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor], metrics: WorkerMetrics | None,
        host_caches: list[torch.Tensor] | None = None, external: ExternalIO | None = None, transfer: KVTransfer | None = None,
    ):
        self.config = config
        self.serving = serving
        self.model = serving.model
        # NOTE: the only KV allocation of the process, made before hello; a
        # re-handshake reuses it. Each (2, num_blocks, block_size, kv_heads, head_dim),
        # one entry per layer (layers of different KV-cache groups may share one).
        self.kv_caches = kv_caches
        self.hello_num_blocks = kv_caches[0].shape[1]  # what fits our budget
        # The offload tier's host memory (--kv-offloading-size), also allocated before
        # hello; freed when a scheduler wants no host tier (then offered no more).
        self.host_caches = host_caches or None
        self.metrics = metrics
        self.codec: Codec = Codec(SchedulerToWorker)
        self.runner: ModelRunner | None = None
        # Structured outputs: compiled off the step path, kept across re-handshakes.
        self.grammars = GrammarCompiler(serving.directory, serving.config.vocab_size)
        # This worker's presence on the host (every CPU worker's), taken with the first runner.
        self.host_peers: HostPeers | None = None
        # Each step's thread count on CPU, built with the first runner and kept after.
        self.step_threads: StepThreads | None = None
        # The external KV tier (disk, Mooncake Store): its saves and loads, on a thread of their own.
        self.external = external
        if external is not None and metrics is not None:
            metrics.watch_external(external)
        # P/D disaggregation (--kv-transfer-config): lent blocks served, pulls, each on a thread of its own.
        self.transfer = transfer
        if transfer is not None and metrics is not None:
            metrics.watch_kv_transfer(transfer)

    def hello(self) -> WorkerHello:
        c, s = self.config, self.serving
        m = s.config
        return WorkerHello(
            rank=0, world_size=1, num_blocks=self.hello_num_blocks, block_size=c.block_size,
            vocab_size=m.vocab_size, eos_token_id=m.eos_token_ids[0], num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, device=str(self.model.device),
            architecture=m.architecture, model_hash=s.identity, eos_token_ids=list(m.eos_token_ids),
            max_model_len=s.max_model_len, num_host_blocks=self.hello_num_host_blocks,
            group_windows=hello_group_windows(s.kv_cache_groups) if s.kv_cache_groups else [],
            **hello_fields(self.external), **transfer_ops.hello_fields(self.transfer),
        )

    @property
    def hello_num_host_blocks(self) -> int:
        return 0 if self.host_caches is None else self.host_caches[0].shape[1]

    def run(self, ctx: zmq.Context) -> int:
        """Serve until Shutdown (0) or a fatal condition (non-zero)."""
        try:
            return self._run(ctx)
        finally:
            if self.host_peers is not None:
                self.host_peers.close()

    def _run(self, ctx: zmq.Context) -> int:
        while True:
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            if self.config.curve_client_key is not None:
                apply_client(sock, self.config.curve_client_key, self.config.curve_server_key)
            sock.connect(self.config.scheduler)
            try:
                ready = self._handshake(sock)
                refused = self._install(ready)
                if refused is not None:
                    self._send(sock, WorkerError(refused))
                    log.error("refusing WorkerReady: %s", refused)
                    return EXIT_REFUSED
                self._send(sock, Heartbeat(sent_at=time.time()))  # acknowledges WorkerReady
                return self._serve(sock)
            except Refused as e:
                log.error("refused by the scheduler at %s: %s", self.config.scheduler, e)
                return EXIT_REFUSED
            except SchedulerLost as e:
                if not self.config.reconnect:
                    log.error("%s; exiting (use --reconnect to handshake again instead)", e)
                    return EXIT_SCHEDULER_LOST
                log.warning("%s; dropping every row and handshaking again", e)
                self._set_ready(None)
            except WorkerStopping:
                log.info("SIGTERM: telling the scheduler and exiting")
                # NOTE: linger, so the goodbye leaves before the socket closes.
                self._send(sock, WorkerExit("SIGTERM"))
                sock.close(linger=1000)
                return 0
            finally:
                sock.close(linger=0)

    def _set_ready(self, runner: ModelRunner | None) -> None:
        self.runner = runner
        if self.metrics is not None:
            self.metrics.ready = runner is not None

    def _send(self, sock: zmq.Socket, msg) -> None:
        sock.send(self.codec.encode(msg))

    def _recv(self, sock: zmq.Socket):
        frames = sock.recv_multipart()
        # NOTE: the message is the last frame, so an empty delimiter frame (REQ-style
        # envelope) from the scheduler is tolerated.
        return self.codec.decode(frames[-1])

    def _handshake(self, sock: zmq.Socket) -> WorkerReady:
        """WorkerReady; Refused on Shutdown, SchedulerLost after scheduler_timeout_s."""
        self._send(sock, self.hello())
        log.info("sent WorkerHello (%d blocks of %d tokens) to %s", self.hello_num_blocks, self.config.block_size, self.config.scheduler)
        timeout = self.config.scheduler_timeout_s
        start = time.monotonic()
        while True:
            waited = time.monotonic() - start
            if waited >= timeout:
                raise SchedulerLost(
                    f"no WorkerReady from the scheduler at {self.config.scheduler} within {timeout} s "
                    "(--scheduler-timeout): is it running, and is --scheduler its worker port?"
                )
            if not sock.poll(math.ceil(min(5.0, timeout - waited) * 1000)):
                log.info("still waiting for WorkerReady from %s (%.0f s)", self.config.scheduler, time.monotonic() - start)
                continue
            try:
                msg = self._recv(sock)
            except ProtocolError as e:
                self._send(sock, WorkerError(str(e)))
                continue
            match msg:
                case WorkerReady():
                    return msg
                case Shutdown(reason=reason):
                    raise Refused(reason or "(no reason given)")
                case Heartbeat():
                    pass
                case StepPlan(step_id=step_id):
                    self._send(sock, WorkerError("plan before WorkerReady", step_id=step_id))

    def _install(self, ready: WorkerReady) -> str | None:
        """Size the cache and the runner from WorkerReady; a reason string if refused."""
        c = self.config
        if ready.block_size != c.block_size:
            return f"WorkerReady block_size {ready.block_size} differs from this worker's {c.block_size}"
        if not 2 <= ready.num_blocks <= self.hello_num_blocks:
            return f"WorkerReady num_blocks {ready.num_blocks} is outside 2..{self.hello_num_blocks} (what fits this worker)"
        if ready.max_num_seqs < 1 or ready.max_model_len < 1:
            return f"WorkerReady max_num_seqs {ready.max_num_seqs} / max_model_len {ready.max_model_len} must be positive"
        if ready.max_model_len > self.serving.max_model_len:
            return f"WorkerReady max_model_len {ready.max_model_len} is over this worker's {self.serving.max_model_len}"
        if not 0 <= ready.num_host_blocks <= self.hello_num_host_blocks:
            return f"WorkerReady num_host_blocks {ready.num_host_blocks} is outside 0..{self.hello_num_host_blocks} (the host tier this worker holds)"
        if ready.num_host_blocks == 0 and self.host_caches is not None:
            log.info("the scheduler manages no host tier: freeing its %d slots", self.hello_num_host_blocks)
            self.host_caches = None
        hosts = None if self.host_caches is None else [h[:, : ready.num_host_blocks] for h in self.host_caches]
        caches = first_blocks(self.kv_caches, ready.num_blocks)
        s = self.serving
        runner = ModelRunner(self.model, caches, ready.max_num_seqs, ready.max_model_len, ready.next_step_id, seed=c.seed, host_caches=hosts,
                             grammar_compiler=self.grammars, kv_scales=list(s.kv_scales), groups=list(s.kv_cache_groups) or None,
                             layer_windows=s.layer_windows or None, step_threads=self._step_threads())
        self._set_ready(runner)
        if self.metrics is not None:
            self.metrics.num_blocks.set(ready.num_blocks)
            self.metrics.num_host_blocks.set(ready.num_host_blocks)
            self.metrics.host_kv_bytes.set(sum(h.numel() * h.element_size() for h in self.host_caches or []))
            self.metrics.reset_totals()
        log.info(
            "ready: %d blocks, max_num_seqs %d, max_model_len %d, next step %d",
            ready.num_blocks, ready.max_num_seqs, ready.max_model_len, ready.next_step_id,
        )
        return None

    def _serve(self, sock: zmq.Socket) -> int:
        monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        try:
            return self._serve_until_lost(sock, monitor)
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)

    def _serve_until_lost(self, sock: zmq.Socket, monitor: zmq.Socket) -> int:
        """Answer the scheduler until Shutdown; SchedulerLost after its silence or as soon as
        its connection drops (a scheduler that died and is restarting: the next one is a
        new handshake, with ``reconnect``)."""
        timeout, interval = self.config.scheduler_timeout_s, self.config.heartbeat_interval_s
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        last_heard = last_sent = time.monotonic()
        while True:
            now = time.monotonic()
            wait = min(last_heard + timeout, last_sent + interval) - now
            if self.grammars.has_pending or (self.external is not None and self.external.has_pending_loads) or (
                self.transfer is not None and self.transfer.awaits_news
            ):
                # NOTE: a compile, a load, a pull or a read of a lend ends on another thread: look for it often meanwhile.
                wait = min(wait, GRAMMAR_POLL_S)
            # NOTE: poll even when the wait is over, so a message that queued up
            # during a long step counts as heard rather than as a timeout.
            ready = dict(poller.poll(max(0, math.ceil(wait * 1000))))
            if monitor in ready and not ready.get(sock):
                monitor.recv_multipart()
                raise SchedulerLost(f"lost the connection to the scheduler at {self.config.scheduler}")
            if ready:
                reply = self._handle(sock)
                if reply is None:
                    return 0
                # NOTE: news first: a load that ended during the step is heard before its result, so the
                # scheduler's next plan schedules its request.
                sent = self._send_news(sock)
                if reply is not False:
                    self._send(sock, reply)
                    sent = True
                last_heard = time.monotonic()
                if sent:
                    last_sent = last_heard
                continue
            if self._send_news(sock):
                last_sent = time.monotonic()
            now = time.monotonic()
            if now - last_heard >= timeout:
                raise SchedulerLost(f"no message from the scheduler at {self.config.scheduler} for {now - last_heard:.1f} s (--scheduler-timeout {timeout} s)")
            if now - last_sent >= interval:
                self._send(sock, Heartbeat(sent_at=time.time()))
                last_sent = now

    def _send_news(self, sock: zmq.Socket) -> bool:
        """Grammars compiled, external loads and KV pulls ended, lent KV read since the last news; False if none."""
        sent = self._send_grammars_ready(sock)
        if self.external is not None and (done := self.external.take_done()) is not None:
            self._send(sock, ExternalKVDone(*done))
            sent = True
        if self.transfer is not None and (done := self.transfer.take_done()) is not None:
            self._send(sock, KVTransferDone(*done))
            sent = True
        return sent

    def _send_grammars_ready(self, sock: zmq.Socket) -> bool:
        """Tell the scheduler which grammars finished compiling; False if none did."""
        if not self.grammars.has_pending:
            return False
        ready, failed = self.grammars.take_finished()
        if not ready and not failed:
            return False
        self._send(sock, GrammarsReady(ready, [s for s, _ in failed], [e for _, e in failed]))
        return True

    def _handle(self, sock: zmq.Socket):
        """The reply to one incoming message: a message, False for none, None to exit."""
        try:
            msg = self._recv(sock)
        except ProtocolError as e:
            log.warning("bad frame from the scheduler: %s", e)
            return WorkerError(str(e))
        match msg:
            case StepPlan():
                return self._execute(msg)
            case Heartbeat():
                return False
            case CompileGrammars(seq_ids=seq_ids, grammars=grammars):
                if len(seq_ids) != len(grammars):
                    return WorkerError(f"CompileGrammars: {len(seq_ids)} seq ids for {len(grammars)} grammars")
                ready = self.grammars.submit(seq_ids, grammars)
                return GrammarsReady(ready) if ready else False
            case Shutdown(reason=reason):
                log.info("shutdown: %s", reason or "(no reason)")
                return None
            case WorkerReady():
                return WorkerError("unexpected WorkerReady: this worker is already ready")

    def _step_threads(self) -> StepThreads | None:
        """On CPU, a big step on every core (``--cpu-wide-step-tokens``, by default from the
        model's size) while no other worker runs on this host (worker/host_peers.py, where
        this worker registers) and no other process keeps a core busy (worker/host_load.py);
        None elsewhere. Built once, kept across handshakes."""
        c, m = self.config, self.model
        if m.device.type != "cpu":
            return None
        if self.step_threads is not None:
            return self.step_threads
        tokens = c.cpu_wide_step_tokens
        if tokens is None:
            mc = m.config
            tokens = wide_step_tokens(projection_weights(mc.hidden_size, mc.intermediate_size, mc.num_layers,
                                                         m.num_heads * mc.head_dim, m.num_kv_heads * mc.head_dim))
        if self.host_peers is None:  # NOTE: every CPU worker says it is here, wide or not
            try:
                self.host_peers = HostPeers()
            except OSError as e:
                log.warning("cannot register in %s (%s): big steps go wide even beside another worker", default_directory(), e)
        wide = wide_num_threads(os.environ, os.cpu_count(), c.tensor_parallel_size)
        self.step_threads = StepThreads(wide, tokens, self.host_peers, HostLoad(c.serve_pid))
        if self.metrics is not None:
            self.metrics.watch_step_threads(self.step_threads)
        return self.step_threads

    def _execute(self, plan: StepPlan) -> StepResult | WorkerError:
        runner = self.runner
        t0 = time.perf_counter()
        try:
            loads_started = before_step(self.external, plan, runner.limits.num_blocks)
            pulls_started = transfer_ops.before_step(self.transfer, plan, runner.limits.num_blocks)
            out = runner.execute(plan)
        except PlanError as e:
            log.warning("refused plan %d: %s", plan.step_id, e)
            return WorkerError(str(e), step_id=plan.step_id)
        after_step(self.external, plan, loads_started)
        transfer_ops.after_step(self.transfer, plan, pulls_started)
        elapsed = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.observe_step(elapsed, runner.num_tokens_computed, runner.kv_bytes_written)
            if (t := runner.tier) is not None:
                self.metrics.observe_tier(t.store_bytes, t.store_seconds, t.load_bytes, t.load_seconds)
        logprobs = [] if out.logprobs is None else [
            SampledLogprobs(sid, lp.logprob, lp.top_token_ids, lp.top_logprobs)
            for sid, lp in zip(out.seq_ids, out.logprobs, strict=True) if lp is not None
        ]
        if out.extra_logprobs and logprobs:
            logprobs = _with_extra_logprobs(logprobs, out.extra_logprobs)
        return StepResult(plan.step_id, out.seq_ids, out.sampled_token_ids, elapsed, logprobs, out.prompt_logprobs or {},
                          out.extra_token_ids or {})


def _with_extra_logprobs(logprobs: list[SampledLogprobs], extra: dict) -> list[SampledLogprobs]:
    """Each row's logprobs, first token then its extra tokens' (speculative decoding), in row order."""
    merged = []
    for lp in logprobs:
        merged.append(lp)
        for more in extra.get(lp.seq_id, ()):
            if more is not None:
                merged.append(SampledLogprobs(lp.seq_id, more.logprob, more.top_token_ids, more.top_logprobs))
    return merged
