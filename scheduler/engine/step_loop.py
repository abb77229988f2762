"""The scheduler's step loop: schedule -> send the plan -> await its result -> stream tokens out.

`EngineCore` (scheduler/engine/engine_core.py) starts one `StepLoop` beside the
ports' receive loops and stops it at a step boundary. Steps are strictly
sequential: a plan is sent only after the previous result is applied, which is
what makes caching blocks at scheduling time safe (rule 3). With no worker, the
loop keeps the link's clock (silence, pins, lends) and fails requests that waited
longer than --worker-reconnect-timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from protocol.worker_messages import CompileGrammars, StepResult
from scheduler.core.kv_events import KVEventRecorder
from scheduler.engine.client_outputs import outputs_by_client
from scheduler.engine.client_side import ClientSide
from scheduler.engine.engine_state import EngineState
from scheduler.engine.kv_event_publisher import KVEventPublisher
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.model_shape import ModelShape
from scheduler.engine.perf_metrics import StepContext, estimate_step
from scheduler.engine.stats_logger import IterationDetailsLogger
from scheduler.engine.worker_checks import check_result
from scheduler.engine.worker_link import HEARTBEAT_INTERVAL_S, WorkerLink, WorkerLost
from scheduler.sched.outputs import SchedulerOutput, StepTokens
from scheduler.sched.prompt_logprobs import gather_prompt_logprobs
from scheduler.sched.request import RequestStatus

log = logging.getLogger("scheduler")


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


class StepLoop:
    """The scheduler's steps, one at a time, as one task (`run`)."""

    def __init__(
        self, state: EngineState, worker: WorkerLink, client_side: ClientSide, metrics: SchedulerMetrics,
        kv_event_sink: KVEventRecorder | None, kv_event_publisher: KVEventPublisher | None,
        model_shape: ModelShape | None, iteration_log: IterationDetailsLogger, worker_reconnect_timeout_s: float,
    ):
        """``model_shape``: with --enable-mfu-metrics, else None."""
        self.state, self.worker, self.client_side, self.metrics = state, worker, client_side, metrics
        self.kv_event_sink, self.kv_event_publisher = kv_event_sink, kv_event_publisher
        self.model_shape, self.iteration_log = model_shape, iteration_log
        self.worker_reconnect_timeout_s = worker_reconnect_timeout_s
        self._step_kv_events: list = []  # see run

    def publish_kv_events(self) -> None:
        """One batch per step (and per reset): what the pool's cache gained and lost;
        a finished step's events set apart by the step loop go first."""
        if self.kv_event_publisher is not None:
            if self._step_kv_events:
                self.kv_event_publisher.publish(self._step_kv_events)
            self._step_kv_events = []
            self.kv_event_publisher.publish(self.kv_event_sink.take_events())

    async def run(self) -> None:
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
        timeout_s, lost_at = self.worker_reconnect_timeout_s, self.state.worker_lost_at
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
            self._step_kv_events = self.kv_event_sink.take_events()
        return _Done(outputs, result.logprobs, prompt_logprobs, nbytes, time.perf_counter() - t0, perf)

    async def _deliver(self, done: _Done) -> None:
        """A finished step's outputs to its clients, then its metrics and KV events."""
        await self.client_side.send_outputs(outputs_by_client(done.outputs, done.logprobs, done.prompt_logprobs))
        self.metrics.observe_step(done.outputs, done.nbytes, done.seconds)
        if done.perf is not None:
            self.metrics.observe_perf(*done.perf)
        self.metrics.update(self.state.scheduler, self.state.kv)
        self.publish_kv_events()
