"""The scheduler process: sockets, the worker handshake, the step loop, faults.

One asyncio loop (uvloop) runs these tasks over two ZMQ ROUTER ports and HTTP:

* clients: Generate / Abort in; one EngineCoreOutputs per client per step (a
  TokenOutput per request), or a RequestError;
* worker: WorkerHello -> WorkerReady -> its acknowledging Heartbeat (the BlockPool
  is built only then), then StepResults (scheduler/engine/worker_side.py, the link's
  state machine in scheduler/engine/worker_link.py);
* steps: schedule -> send the plan -> await its result -> stream tokens out;
* watchers: a peer disconnecting on either port is probed at once.

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

from protocol.client_messages import Abort, ClientRequest, EngineCoreOutputs, Generate, RequestError
from protocol.codec import Codec, ProtocolError
from protocol.sampling_params import sampling_params_of
from protocol.worker_messages import (
    Shutdown,
    WorkerToScheduler,
)
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.engine.client_outputs import final_outputs_by_client, outputs_by_client, send_outputs
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.http_server import build_app, start_http
from scheduler.engine.kv_event_publisher import make_kv_event_sink
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.sockets import LoopYield, open_ports, peer_name
from scheduler.engine.worker_checks import check_result
from scheduler.engine.worker_link import HEARTBEAT_INTERVAL_S, WorkerLink, WorkerLost
from scheduler.engine.worker_side import WorkerSide
from scheduler.sched.outputs import StepOutputs
from scheduler.sched.request import Request, RequestStatus
from scheduler.sched.scheduler import Scheduler
from scheduler.sched.validation import RequestLimits, RequestRejected, validate_generate

log = logging.getLogger("scheduler")


@dataclass(slots=True)
class _Done:
    """A step whose results the scheduler has applied, its outputs not yet sent."""

    outputs: StepOutputs
    logprobs: list  # StepResult.logprobs
    nbytes: int
    seconds: float


class EngineCore(WorkerSide):
    def __init__(self, config: SchedulerConfig):
        self.config = config
        self.ctx = zmq.asyncio.Context()
        self.clients, self.workers, self.authenticator = open_ports(self.ctx, config)
        key = config.curve_secret_key
        self.worker = WorkerLink(self.workers, Codec(WorkerToScheduler), config.worker_timeout_s, self._on_worker_lost)
        self.kv_event_sink, self.kv_event_publisher = make_kv_event_sink(
            self.ctx, config.kv_events_endpoint, config.kv_events_replay_endpoint,
            config.kv_events_topic, config.kv_events_buffer_steps, curve_secret_key=key,
            int_block_hashes=config.kv_events_int_block_hashes, data_parallel_rank=config.data_parallel_rank,
        )  # fmt: skip
        self.client_codec: Codec = Codec(ClientRequest, config.max_frame_bytes)
        self.metrics = SchedulerMetrics(
            config.model_name, kv_cache_metrics=config.kv_cache_metrics, kv_offloading=config.kv_offloading_size > 0
        )
        self.hasher = BlockHasher(config.block_size, config.prefix_caching_hash_algo)
        # Made when the first worker acknowledges WorkerReady (the pool's size is known); kept after.
        self.kv: KVCacheManager | None = None
        self.scheduler: Scheduler | None = None
        self.limits: RequestLimits | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.model_identity = ("", "")  # (architecture, model_hash) of the first worker
        self.worker_lost_at: float | None = None
        self._wakeup = asyncio.Event()
        self._step_kv_events: list = []  # see _step_loop
        self._stop = asyncio.Event()
        self._stopping = False
        # An internal error that stopped the process (exit status 1).
        self._fatal: BaseException | None = None
        self._next_seq_id = 0

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
                self._client_loop(), self._worker_loop(),
                self.clients.watch_disconnects(self._sweep_clients), self.workers.watch_disconnects(self._probe_worker),
            )
        ]  # fmt: skip
        for t in (step, *others):
            t.add_done_callback(self._on_task_done)
        await self._stop.wait()
        # Steps stop at a step boundary; then everything still live ends with "abort".
        # NOTE: the worker loop (others[1]) must outlive the step in flight: it
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
        await self._end_all(RequestStatus.FINISHED_ABORTED)
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
        self.clients.close()
        self.workers.close()
        if self.kv_event_publisher is not None:
            self.kv_event_publisher.close()
        if self.authenticator is not None:
            self.authenticator.stop()
        self.ctx.term()

    def _on_task_done(self, task: asyncio.Task) -> None:
        """A loop that ends by itself is a bug: say so loudly and stop, rather than go
        on serving /health while nothing is scheduled."""
        if task.cancelled() or self._stopping:
            return
        self._fatal = task.exception() or RuntimeError(f"task {task.get_coro().__qualname__} ended")
        log.critical("internal error in %s; stopping", task.get_coro().__qualname__, exc_info=task.exception())
        self.request_stop()

    def request_stop(self) -> None:
        if not self._stopping:
            log.info("stopping: no new requests; running ones end with finish reason 'abort'")
        self._stopping = True
        self._stop.set()
        self._wakeup.set()

    async def _end_all(self, status: RequestStatus, message: str = "") -> None:
        """End every live request; each client hears of it (abort, or a RequestError)."""
        if self.scheduler is None:
            return
        ended = self.scheduler.finish_requests(list(self.scheduler.requests), status)
        if status == RequestStatus.FINISHED_ERROR:
            for request in ended:
                await self._send_error(request.client_id, request.request_id, message)
        else:
            await self._send_outputs(final_outputs_by_client(ended, status.value))

    # --- clients ----------------------------------------------------------------------

    async def _client_loop(self) -> None:
        pause = LoopYield()
        while True:
            await pause()
            frames, num_frames = await self.clients.recv()
            ident = frames[0].bytes
            if num_frames != 2:
                await self._send_error(ident, None, f"expected one frame per message, got {num_frames - 1}")
                continue
            try:
                msg = self.client_codec.decode(frames[1].buffer)
            except ProtocolError as e:
                await self._send_error(ident, None, str(e))
                continue
            match msg:
                case Generate():
                    await self._on_generate(ident, msg)
                case Abort(request_id=rid):
                    await self._on_abort(ident, rid)

    async def _on_generate(self, ident: bytes, msg: Generate) -> None:
        if self._stopping:
            return await self._send_error(ident, msg.request_id, "the scheduler is shutting down")
        if not self.worker.ready or self.scheduler is None:
            return await self._send_error(ident, msg.request_id, "no worker is ready: try again once /health returns 200")
        try:
            validate_generate(msg, self.limits, self.scheduler.requests)
        except RequestRejected as e:
            return await self._send_error(ident, msg.request_id, str(e))
        if self.scheduler.num_waiting >= self.config.max_num_waiting:
            return await self._send_error(
                ident, msg.request_id,
                f"the waiting queue is full ({self.scheduler.num_waiting} requests, --max-num-waiting): try again later",
            )  # fmt: skip
        request = Request(
            msg.request_id, msg.prompt_token_ids, msg.max_tokens, seq_id=self._next_seq_id, client_id=ident,
            ignore_eos=msg.ignore_eos, eos_token_id=self.eos_token_ids, cache_salt=msg.cache_salt, block_hasher=self.hasher,
            stop_token_ids=msg.stop_token_ids, min_tokens=msg.min_tokens, sampling=sampling_params_of(msg, self.eos_token_ids),
        )  # fmt: skip
        self._next_seq_id += 1
        self.scheduler.add_request(request)
        self._wakeup.set()

    async def _on_abort(self, ident: bytes, request_id: str) -> None:
        request = self.scheduler.requests.get(request_id) if self.scheduler else None
        if request is None or request.client_id != ident:
            return await self._send_error(ident, request_id, f"unknown request id {request_id!r}: nothing to abort")
        self.scheduler.finish_requests([request_id], RequestStatus.FINISHED_ABORTED)
        await self._send_outputs(final_outputs_by_client([request], "abort"))
        self._wakeup.set()

    async def _send_error(self, ident: bytes, request_id: str | None, message: str) -> None:
        log.debug("request error to %r: %s", ident, message)
        # NOTE: an error reply that cannot be delivered is dropped: the peer is gone or
        # is flooding without reading, and nothing else is owed to it.
        await self.clients.send(ident, self.client_codec.encode(RequestError(message, request_id)))

    async def _send_outputs(self, batches: dict[bytes, EngineCoreOutputs]) -> None:
        """One frame per client; a client that cannot take it is dropped."""
        for ident in send_outputs(self.clients, self.client_codec, batches):
            self._drop_client(ident)

    def _drop_client(self, ident: bytes) -> None:
        """The client is gone (or stopped reading): abort its requests, free their blocks."""
        if self.scheduler is None:
            return
        ids = [rid for rid, r in self.scheduler.requests.items() if r.client_id == ident]
        if ids:
            log.warning("client %s is gone: aborting its %d requests", peer_name(ident), len(ids))
            self.scheduler.finish_requests(ids, RequestStatus.FINISHED_ABORTED)
            self._wakeup.set()

    async def _sweep_clients(self) -> None:
        """A client disconnected: probe every client with live requests (an empty
        EngineCoreOutputs is a no-op for a client) and drop those that are gone."""
        if self.scheduler is None:
            return
        probe = EngineCoreOutputs()
        await self._send_outputs({r.client_id: probe for r in self.scheduler.requests.values()})

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
            while not self._stopping:
                self._wakeup.clear()
                now = time.monotonic()
                self.worker.check_silence()
                if self.worker_lost_at is not None and now - self.worker_lost_at > self.config.worker_reconnect_timeout_s:
                    if self.scheduler.has_unfinished_requests():
                        log.error("no worker for %.0f s: failing %d waiting requests", now - self.worker_lost_at, self.scheduler.num_waiting)
                        await self._end_all(RequestStatus.FINISHED_ERROR, f"no worker returned within {self.config.worker_reconnect_timeout_s} s")
                out = self.scheduler.schedule() if self.worker.ready else None
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
                        await asyncio.wait_for(self._wakeup.wait(), HEARTBEAT_INTERVAL_S)
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
                    check_result(result, self.limits.vocab_size)
                    outputs = self.scheduler.update_from_output(result)
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
        await self._send_outputs(outputs_by_client(done.outputs, done.logprobs))
        self.metrics.observe_step(done.outputs, done.nbytes, done.seconds)
        self.metrics.update(self.scheduler, self.kv)
        self._publish_kv_events()

    # --- HTTP -------------------------------------------------------------------------

    def _render_metrics(self) -> bytes:
        if self.scheduler is not None:
            self.metrics.update(self.scheduler, self.kv)
        return self.metrics.render()

    def _health(self) -> tuple[bool, str]:
        if self._stopping:
            return False, "shutting down"
        return (True, "ok") if self.worker.ready else (False, "no worker is ready")

    def _http_reset_prefix_cache(self) -> tuple[bool, str]:
        if self.kv is None:
            return False, "no pool yet: no worker has connected"
        if self.kv.reset_prefix_cache():
            self._publish_kv_events()
            return True, "prefix cache reset"
        used = self.kv.block_pool.num_gpu_blocks - 1 - self.kv.block_pool.get_num_free_blocks()
        return False, f"refused: {used} blocks are held by running requests"
