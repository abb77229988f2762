"""The worker's process loop: what each message from the scheduler does. The link itself
(the socket, the handshake, silence and heartbeats) is ``worker.scheduler_link``.

* The KV cache is allocated before any of this (``worker.startup``): a hello
  promises only memory the worker holds, and reports it (``hello``).
* WorkerReady: use the number of blocks the scheduler chose (at most ours) with no rows,
  and build the step runner (``_install``); the link acknowledges it with a Heartbeat
  (the scheduler is ready only once it hears it).
* Then answer each StepPlan with a StepResult (or a WorkerError, state unchanged);
  Shutdown exits 0. Between messages, tell the scheduler the news: grammars compiled,
  external loads and KV pulls ended (``_send_news``).
"""

from __future__ import annotations

import logging
import os
import time

import torch
import zmq

from protocol.codec import ProtocolError
from protocol.worker_messages import (
    CompileGrammars,
    ExternalKVDone,
    GrammarsReady,
    Heartbeat,
    KVTransferDone,
    SampledLogprobs,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerReady,
)
from worker.config import WorkerConfig
from worker.cpu.host_load import HostLoad
from worker.cpu.host_peers import HostPeers, default_directory
from worker.cpu.threads import StepThreads, projection_weights, wide_num_threads, wide_step_tokens
from worker.external.external_io import ExternalIO
from worker.external.plan_ops import after_step, before_step, hello_fields
from worker.kv.kv_cache import block_bytes, dtype_name, first_blocks
from worker.load.serving_model import ServingModel
from worker.metrics import WorkerMetrics
from worker.sample.grammar_compiler import GrammarCompiler
from worker.scheduler_link import SchedulerLink
from worker.step.group_tables import hello_group_windows
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner
from worker.transfer import plan_ops as transfer_ops
from worker.transfer.kv_transfer import KVTransfer

log = logging.getLogger("worker")


class WorkerProcess(SchedulerLink):
    def __init__(
        self, config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor], metrics: WorkerMetrics | None,
        host_caches: list[torch.Tensor] | None = None, external: ExternalIO | None = None, transfer: KVTransfer | None = None,
    ):
        super().__init__(config)
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
        c, s, kv = self.config, self.serving, self.kv_caches[0]
        m = s.config
        return WorkerHello(
            rank=0, world_size=1, num_blocks=self.hello_num_blocks, block_size=c.block_size,
            vocab_size=m.vocab_size, eos_token_id=m.eos_token_ids[0], num_layers=m.num_layers,
            num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, device=str(self.model.device),
            architecture=m.architecture, model_hash=s.identity, eos_token_ids=list(m.eos_token_ids),
            max_model_len=s.max_model_len, num_host_blocks=self.hello_num_host_blocks,
            group_windows=hello_group_windows(s.kv_cache_groups) if s.kv_cache_groups else [],
            **hello_fields(self.external), **transfer_ops.hello_fields(self.transfer),
            kv_cache_dtype=dtype_name(kv.dtype), kv_cache_dtype_size=kv.element_size(), kv_block_bytes=block_bytes(self.kv_caches),
            dtype=dtype_name(self.model.dtype), dtype_size=self.model.dtype.itemsize,
        )

    @property
    def hello_num_host_blocks(self) -> int:
        return 0 if self.host_caches is None else self.host_caches[0].shape[1]

    def run(self, ctx: zmq.Context) -> int:
        """Serve until Shutdown (0) or a fatal condition (non-zero)."""
        try:
            return super().run(ctx)
        finally:
            if self.host_peers is not None:
                self.host_peers.close()

    def _set_ready(self, runner: ModelRunner | None) -> None:
        self.runner = runner
        if self.metrics is not None:
            self.metrics.ready = runner is not None

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

    def _awaits_news(self) -> bool:
        """Whether a compile, a load, a pull or a read of a lend is under way on another thread."""
        return self.grammars.has_pending or (self.external is not None and self.external.has_pending_loads) or (
            self.transfer is not None and self.transfer.awaits_news)

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
        model's size) while no other worker runs on this host (worker/cpu/host_peers.py, where
        this worker registers) and no other process keeps a core busy (worker/cpu/host_load.py);
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
