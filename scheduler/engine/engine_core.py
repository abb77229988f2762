"""The scheduler process: its tasks and their lifecycle, and the step loop.

One asyncio loop (uvloop) runs these tasks over two ZMQ ROUTER ports and HTTP
(/metrics, /health: scheduler/engine/http_server.py):

* clients: Generate / Abort in; one EngineCoreOutputs per client per step (a
  TokenOutput per request), or a RequestError (scheduler/engine/client_side.py);
* worker: WorkerHello -> WorkerReady -> its acknowledging Heartbeat (the BlockPool
  is built only then), then StepResults (scheduler/engine/worker_side.py, the link's
  state machine in scheduler/engine/worker_link.py);
* steps: schedule -> send the plan -> await its result -> stream tokens out;
* watchers: a peer disconnecting on either port is probed at once.

What these parts share (the pool, the policy, the wake-up) is one `EngineState`.
Steps are strictly sequential: a plan is sent only after the previous result is
applied, which is what makes caching blocks at scheduling time safe (rule 3).

Faults (docs/operations.md): a worker that is gone or silent sends its running
requests back to waiting, as if preempted, and voids the prefix cache; a returning
worker resumes them. With no worker for --worker-reconnect-timeout, waiting
requests end with a RequestError. A client that is gone has its requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from dataclasses import dataclass
from functools import partial

import zmq.asyncio

from protocol.speculative_config import parse_speculative_config
from protocol.worker_messages import CompileGrammars, Shutdown, StepResult
from scheduler.core.vllm_hashing import make_block_hasher
from scheduler.engine.client_outputs import outputs_by_client
from scheduler.engine.client_side import ClientSide
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_info import engine_info
from scheduler.engine.engine_state import EngineState
from scheduler.engine.http_server import HttpSide
from scheduler.engine.kv_event_publisher import make_kv_event_sink
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.perf_metrics import ModelShape, StepContext, estimate_step
from scheduler.engine.sockets import open_ports
from scheduler.engine.stats_logger import IterationDetailsLogger, log_stats_every, stats_snapshot
from scheduler.engine.worker_checks import check_result
from scheduler.engine.worker_link import HEARTBEAT_INTERVAL_S, WorkerLost
from scheduler.engine.worker_side import WorkerSide
from scheduler.sched.outputs import SchedulerOutput, StepTokens
from scheduler.sched.prompt_logprobs import gather_prompt_logprobs
from scheduler.sched.request import RequestStatus

log = logging.getLogger("scheduler")
# SIGTERM and SIGINT stop the process.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


@dataclass(slots=True)
class _Done:
    """A step whose results the scheduler has applied, its outputs not yet sent."""

    outputs: StepTokens
    logprobs: list  # StepResult.logprobs
    prompt_logprobs: dict  # seq_id -> the whole prompt's, with the first token (scheduler.sched.prompt_logprobs)
    nbytes: int
    seconds: float
    # (flops, bytes read, bytes written) per GPU, with --enable-mfu-metrics.
    perf: tuple[int, int, int] | None


class EngineCore:
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ctx = zmq.asyncio.Context()
        clients, workers, self.authenticator = open_ports(self.ctx, config)
        key = config.curve_secret_key
        self.kv_event_sink, self.kv_event_publisher = make_kv_event_sink(
            self.ctx, config.kv_events_endpoint, config.kv_events_replay_endpoint,
            config.kv_events_topic, config.kv_events_buffer_steps, curve_secret_key=key,
            int_block_hashes=config.kv_events_int_block_hashes, data_parallel_rank=config.data_parallel_rank,
            endpoint_mode=config.kv_events_endpoint_mode, hwm=config.kv_events_hwm,
        )
        self.metrics = SchedulerMetrics(
            config.model_name, kv_cache_metrics=config.kv_cache_metrics, kv_offloading=config.kv_offloading_size > 0,
            max_model_len=config.max_model_len, custom_buckets=config.custom_histogram_buckets,
            speculative=parse_speculative_config(config.speculative_config),
        )
        self.model_shape = ModelShape.from_checkpoint(config.model) if config.enable_mfu_metrics else None
        self.state = EngineState()
        self.worker_side = WorkerSide(self.state, config, workers, self.metrics, self.kv_event_sink, self._publish_kv_events)
        self.worker = self.worker_side.link
        hasher = make_block_hasher(config.block_size, config.prefix_caching_hash_algo, config.python_hash_seed)
        if config.prefix_caching_hash_algo in ("xxhash", "xxhash_cbor") and config.python_hash_seed is None:
            log.warning("Using a random per-process NONE_HASH seed because %s is not collision resistant. Block hashes are "
                        "therefore not reproducible across processes; set PYTHONHASHSEED to a shared value to reuse the "
                        "prefix cache across instances, or use sha256.", config.prefix_caching_hash_algo)
        self.client_side = ClientSide(
            self.state, clients, hasher, config.max_frame_bytes, config.max_num_waiting, self.metrics.record_admission_rejection,
            self.metrics.request_metrics.observe_finished,
        )
        self.worker_side.end_requests = self.client_side.end
        self.http_side = HttpSide(self.state, self.worker, self.metrics, self._publish_kv_events, config.host, config.http_port,
                                  config.dev_mode, engine_info(config), hasher)
        self.iteration_log = IterationDetailsLogger(config.log_stats and config.enable_logging_iteration_details, config.data_parallel_rank)
        self._step_kv_events: list = []  # see _step_loop
        self._stop = asyncio.Event()
        # An internal error that stopped the process (exit status 1).
        self._fatal: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, self._on_stop_signal)
        http = await self.http_side.start()
        if http is None:
            self._close()
            return 1
        log.info(
            "scheduler listening: clients %s, workers %s, http http://%s:%d",
            self.config.client_address, self.config.worker_address, self.config.host, self.config.http_port,
        )
        step, client_tasks, worker_tasks = self._start_tasks()
        await self._stop.wait()
        # Steps stop at a step boundary; then everything still live ends with "abort".
        await self._stop_tasks(step, client_tasks, worker_tasks)
        await self.client_side.end_all(RequestStatus.FINISHED_ABORTED)
        await self._shut_down_worker()
        await http.cleanup()
        self._close()
        return self._exit_status()

    def _start_tasks(self) -> tuple[asyncio.Task, tuple[asyncio.Task, ...], tuple[asyncio.Task, ...]]:
        """The step loop, then each port's receive loop and disconnect watcher."""
        clients, workers = self.client_side, self.worker_side
        step = asyncio.create_task(self._step_loop())
        client_loop = asyncio.create_task(clients.receive_loop())
        worker_loop = asyncio.create_task(workers.receive_loop())
        client_watch = asyncio.create_task(clients.port.watch_disconnects(clients.sweep))
        worker_watch = asyncio.create_task(workers.port.watch_disconnects(workers.probe))
        others = (client_loop, client_watch)
        if self.config.log_stats:
            c, snapshot = self.config, partial(stats_snapshot, self.state)
            others += (asyncio.create_task(log_stats_every(c.log_stats_interval_s, c.data_parallel_rank, snapshot)),)
        for t in (step, *others, worker_loop, worker_watch):
            t.add_done_callback(self._on_task_done)
        return step, others, (worker_loop, worker_watch)

    async def _stop_tasks(self, step: asyncio.Task, client_tasks: tuple[asyncio.Task, ...], worker_tasks: tuple[asyncio.Task, ...]) -> None:
        # NOTE: the worker's receive loop must outlive the step in flight: it
        # delivers that step's result. Cancelled first, it left the step waiting the
        # whole --worker-timeout, then taking the worker for lost (never sent Shutdown).
        for t in client_tasks:
            t.cancel()
        try:
            await asyncio.wait_for(step, timeout=self.config.worker_timeout_s + 1.0)
        except (TimeoutError, asyncio.CancelledError):
            step.cancel()
        except Exception:
            pass  # already logged by _on_task_done
        for t in worker_tasks:
            t.cancel()

    async def _shut_down_worker(self) -> None:
        if self.worker.worker_id is not None:
            try:
                await self.worker.send(Shutdown("scheduler shutting down"))
            except WorkerLost:
                pass

    def _exit_status(self) -> int:
        if self._fatal is not None:
            log.critical("scheduler stopped after an internal error: %r", self._fatal)
            return 1
        log.info("scheduler stopped")
        return 0

    def _close(self) -> None:
        self.client_side.port.close()
        self.worker_side.port.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A loop that ends by itself is a bug: say so loudly and stop, rather than go
        on serving /health while nothing is scheduled."""
        if task.cancelled() or self.state.stopping:
            return
        self._fatal = task.exception() or RuntimeError(f"task {task.get_coro().__qualname__} ended")
        log.critical("internal error in %s; stopping", task.get_coro().__qualname__, exc_info=task.exception())
        self.request_stop()

    def _on_stop_signal(self) -> None:
        # NOTE: once: a second SIGTERM (kvpool serve's, after its process group's) must not
        # end the stop under way; left to the loop, whose close restores the default
        # action, it killed the process in its last moments (status -15).
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
            signal.signal(sig, signal.SIG_IGN)
        self.request_stop()

    def request_stop(self) -> None:
        if not self.state.stopping:
            log.info("stopping: no new requests; running ones end with finish reason 'abort'")
        self.state.stopping = True
        self._stop.set()
        self.state.wakeup.set()

    def _publish_kv_events(self) -> None:
        """One batch per step (and per reset): what the pool's cache gained and lost;
        a finished step's events set apart by the step loop go first."""
        if self.kv_event_publisher is not None:
            if self._step_kv_events:
                self.kv_event_publisher.publish(self._step_kv_events)
            self._step_kv_events = []
            self.kv_event_publisher.publish(self.kv_event_sink.take())

    # --- steps ------------------------------------------------------------------------

    async def _step_loop(self) -> None:
        # NOTE: a step's outputs reach the clients after the next plan has gone to the
        # worker (``_Done``): the worker computes while the scheduler fans out outputs,
        # metrics and KV events, instead of waiting for them every step. The next
        # schedule() needs only update_from_output, which runs at once.
        state, done = self.state, None
        try:
            while not state.stopping:
                state.wakeup.clear()
                now = time.monotonic()
                self.worker.check_silence()
                # NOTE: bounded: an idle loop still wakes every heartbeat interval.
                if state.kv is not None and state.kv.pinned.expire(now):
                    log.info("pins expired: %d blocks pinned now", state.kv.pinned.num_pinned_blocks)
                if state.scheduler is not None and (n := state.scheduler.expire_lends(now)):
                    log.warning("%d requests' blocks freed unread: no decode engine read them within their lease", n)
                if state.worker_lost_at is not None and not self.worker.ready:
                    await self._fail_requests_waiting_too_long(now)
                if self.worker.ready:
                    await self._send_grammar_compiles()
                out = state.scheduler.schedule() if self.worker.ready else None
                if state.scheduler is not None:
                    # vLLM's step gauges (metrics.py): waiting as this schedule left it; usage
                    # and running after the step's result, or now when there is no step.
                    self.metrics.update_waiting_gauges(state.scheduler)
                    if out is None:
                        self.metrics.update_step_gauges(state.scheduler, state.kv)
                if out is None:
                    if done is not None:
                        # Delivering may drop clients (aborts): schedule again first.
                        finished, done = done, None
                        await self._deliver(finished)
                    else:
                        await self._idle()
                    continue
                t0 = time.perf_counter()
                perf = self._step_perf(out)
                self.iteration_log.begin(out)
                self.worker.begin_step(out.plan.step_id)
                try:
                    nbytes = await self.worker.send(out.plan)
                except WorkerLost:
                    nbytes = None  # the link lost the worker; the step was abandoned with it
                if done is not None:
                    finished, done = done, None
                    await self._deliver(finished)
                if nbytes is None:
                    continue
                try:
                    result = await self.worker.await_result()
                except WorkerLost:
                    continue
                done = self._apply_result(result, nbytes, t0, perf)
        finally:
            if done is not None:
                await self._deliver(done)

    async def _send_grammar_compiles(self) -> None:
        """Grammars of requests that arrived since the last step go to the worker to be
        compiled off the step path; its GrammarsReady releases them (grammar_wait.py)."""
        seq_ids, grammars = self.state.scheduler.take_grammar_compiles()
        if seq_ids:
            try:
                await self.worker.send(CompileGrammars(seq_ids, grammars))
            except WorkerLost:
                pass  # the next worker is asked again (recompile_grammars)

    async def _fail_requests_waiting_too_long(self, now: float) -> None:
        """With no worker, fail each request that has waited for one longer than
        --worker-reconnect-timeout (since it arrived, or since the worker was lost):
        a request that came during the outage gets its own full wait."""
        timeout_s, lost_at = self.config.worker_reconnect_timeout_s, self.state.worker_lost_at
        expired = [rid for rid, r in self.state.scheduler.requests.items() if now - max(r.arrival_time, lost_at) > timeout_s]
        if expired:
            log.error("no worker for %.0f s: failing %d requests that waited %g s for one", now - lost_at, len(expired), timeout_s)
            await self.client_side.end(expired, RequestStatus.FINISHED_ERROR, f"no worker returned within {timeout_s:g} s")

    async def _idle(self) -> None:
        """Nothing to schedule: keep the worker's link alive, then sleep until woken."""
        if self.worker.ready:
            try:
                await self.worker.heartbeat_if_idle()
            except WorkerLost:
                pass  # lost (and handled) by the link
        try:
            await asyncio.wait_for(self.state.wakeup.wait(), HEARTBEAT_INTERVAL_S)
        except TimeoutError:
            pass

    def _step_perf(self, out: SchedulerOutput) -> tuple[int, int, int] | None:
        """vLLM's MFU estimates of the step just scheduled (None without --enable-mfu-metrics)."""
        if self.model_shape is None:
            return None
        return estimate_step(self.model_shape, self.worker.hello, StepContext.of_step(out))

    def _apply_result(self, result: StepResult, nbytes: int, t0: float, perf: tuple[int, int, int] | None) -> _Done | None:
        """The step's result into the scheduler; None (the worker lost) if it is not believable."""
        try:
            check_result(result, self.state.limits.vocab_size)
            prompt_logprobs = gather_prompt_logprobs(self.state.scheduler.seq_id_to_request, result)
            outputs = self.state.scheduler.update_from_output(result)
        except ValueError as e:
            self.worker.lose(str(e))
            return None
        self.metrics.update_step_gauges(self.state.scheduler, self.state.kv)
        self.iteration_log.end(self.state.kv)
        # NOTE: this step's KV events are set apart now, before the next schedule()
        # adds its own; whatever publishes next sends them first.
        if self.kv_event_publisher is not None:
            self._step_kv_events = self.kv_event_sink.take()
        return _Done(outputs, result.logprobs, prompt_logprobs, nbytes, time.perf_counter() - t0, perf)

    async def _deliver(self, done: _Done) -> None:
        """A finished step's outputs to its clients, then its metrics and KV events."""
        await self.client_side.send_outputs(outputs_by_client(done.outputs, done.logprobs, done.prompt_logprobs))
        self.metrics.observe_step(done.outputs, done.nbytes, done.seconds)
        if done.perf is not None:
            self.metrics.observe_perf(*done.perf)
        self.metrics.update(self.state.scheduler, self.state.kv)
        self._publish_kv_events()
