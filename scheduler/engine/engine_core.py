"""The scheduler process: its tasks and their lifecycle, and the step loop.

One asyncio loop (uvloop) runs these tasks over two ZMQ ROUTER ports and HTTP:

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

import zmq.asyncio

from protocol.worker_messages import Shutdown
from scheduler.core.hashing import BlockHasher
from scheduler.engine.client_outputs import outputs_by_client
from scheduler.engine.client_side import ClientSide
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_state import EngineState
from scheduler.engine.http_server import build_app, start_http
from scheduler.engine.kv_event_publisher import make_kv_event_sink
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.sockets import open_ports
from scheduler.engine.worker_checks import check_result
from scheduler.engine.worker_link import HEARTBEAT_INTERVAL_S, WorkerLost
from scheduler.engine.worker_side import WorkerSide
from scheduler.sched.outputs import StepOutputs
from scheduler.sched.request import RequestStatus

log = logging.getLogger("scheduler")


@dataclass(slots=True)
class _Done:
    """A step whose results the scheduler has applied, its outputs not yet sent."""

    outputs: StepOutputs
    logprobs: list  # StepResult.logprobs
    nbytes: int
    seconds: float


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
        )  # fmt: skip
        self.metrics = SchedulerMetrics(
            config.model_name, kv_cache_metrics=config.kv_cache_metrics, kv_offloading=config.kv_offloading_size > 0
        )
        self.state = EngineState()
        self.worker_side = WorkerSide(self.state, config, workers, self.metrics, self.kv_event_sink, self._publish_kv_events)
        self.worker = self.worker_side.link
        hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo)
        self.client_side = ClientSide(self.state, clients, self.worker, hasher, config.max_frame_bytes, config.max_num_waiting)
        self._step_kv_events: list = []  # see _step_loop
        self._stop = asyncio.Event()
        # An internal error that stopped the process (exit status 1).
        self._fatal: BaseException | None = None

    # --- lifecycle --------------------------------------------------------------------

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        reset = self._http_reset_prefix_cache if self.config.dev_mode else None
        try:
            http = await start_http(build_app(self._render_metrics, self._health, reset), self.config.host, self.config.http_port)
        except OSError as e:
            log.error("cannot start: HTTP on %s:%d: %s (choose another --http-port)", self.config.host, self.config.http_port, e)
            self._close()
            return 1
        log.info(
            "scheduler listening: clients %s, workers %s, http http://%s:%d",
            self.config.client_address, self.config.worker_address, self.config.host, self.config.http_port,
        )  # fmt: skip
        step = asyncio.create_task(self._step_loop())
        others = [
            asyncio.create_task(c)
            for c in (
                self.client_side.receive_loop(), self.worker_side.receive_loop(),
                self.client_side.port.watch_disconnects(self.client_side.sweep), self.worker_side.port.watch_disconnects(self.worker_side.probe),
            )
        ]  # fmt: skip
        for t in (step, *others):
            t.add_done_callback(self._on_task_done)
        await self._stop.wait()
        # Steps stop at a step boundary; then everything still live ends with "abort".
        # NOTE: the worker's receive loop (others[1]) must outlive the step in flight: it
        # delivers that step's result. Cancelled first, it left the step waiting the
        # whole --worker-timeout, then taking the worker for lost (never sent Shutdown).
        for t in (others[0], others[2]):
            t.cancel()
        try:
            await asyncio.wait_for(step, timeout=self.config.worker_timeout_s + 1.0)
        except (TimeoutError, asyncio.CancelledError):
            step.cancel()
        except Exception:
            pass  # already logged by _on_task_done
        for t in (others[1], others[3]):
            t.cancel()
        await self.client_side.end_all(RequestStatus.FINISHED_ABORTED)
        if self.worker.worker_id is not None:
            try:
                await self.worker.send(Shutdown("scheduler shutting down"))
            except WorkerLost:
                pass
        await http.cleanup()
        self._close()
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
        done: _Done | None = None
        try:
            while not self.state.stopping:
                self.state.wakeup.clear()
                now = time.monotonic()
                self.worker.check_silence()
                if self.state.worker_lost_at is not None and now - self.state.worker_lost_at > self.config.worker_reconnect_timeout_s:
                    if self.state.scheduler.has_unfinished_requests():
                        log.error("no worker for %.0f s: failing %d waiting requests", now - self.state.worker_lost_at, self.state.scheduler.num_waiting)
                        await self.client_side.end_all(RequestStatus.FINISHED_ERROR, f"no worker returned within {self.config.worker_reconnect_timeout_s} s")
                out = self.state.scheduler.schedule() if self.worker.ready else None
                if out is None:
                    if done is not None:
                        # Delivering may drop clients (aborts): schedule again first.
                        finished, done = done, None
                        await self._deliver(finished)
                        continue
                    if self.worker.ready:
                        try:
                            await self.worker.heartbeat_if_idle()
                        except WorkerLost:
                            pass  # lost (and handled) by the link
                    try:
                        await asyncio.wait_for(self.state.wakeup.wait(), HEARTBEAT_INTERVAL_S)
                    except TimeoutError:
                        pass
                    continue
                t0 = time.perf_counter()
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
                try:
                    check_result(result, self.state.limits.vocab_size)
                    outputs = self.state.scheduler.update_from_output(result)
                except ValueError as e:
                    self.worker.lose(str(e))
                    continue
                # NOTE: this step's KV events are set apart now, before the next schedule()
                # adds its own; whatever publishes next sends them first.
                if self.kv_event_publisher is not None:
                    self._step_kv_events = self.kv_event_sink.take()
                done = _Done(outputs, result.logprobs, nbytes, time.perf_counter() - t0)
        finally:
            if done is not None:
                await self._deliver(done)

    async def _deliver(self, done: _Done) -> None:
        """A finished step's outputs to its clients, then its metrics and KV events."""
        await self.client_side.send_outputs(outputs_by_client(done.outputs, done.logprobs))
        self.metrics.observe_step(done.outputs, done.nbytes, done.seconds)
        self.metrics.update(self.state.scheduler, self.state.kv)
        self._publish_kv_events()

    # --- HTTP -------------------------------------------------------------------------

    def _render_metrics(self) -> bytes:
        if self.state.scheduler is not None:
            self.metrics.update(self.state.scheduler, self.state.kv)
        return self.metrics.render()

    def _health(self) -> tuple[bool, str]:
        if self.state.stopping:
            return False, "shutting down"
        return (True, "ok") if self.worker.ready else (False, "no worker is ready")

    def _http_reset_prefix_cache(self) -> tuple[bool, str]:
        kv = self.state.kv
        if kv is None:
            return False, "no pool yet: no worker has connected"
        if kv.reset_prefix_cache():
            self._publish_kv_events()
            return True, "prefix cache reset"
        used = kv.block_pool.num_gpu_blocks - 1 - kv.block_pool.get_num_free_blocks()
        return False, f"refused: {used} blocks are held by running requests"
