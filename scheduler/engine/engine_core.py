"""The scheduler process: its parts, its tasks and their lifecycle.

One asyncio loop (uvloop) runs these tasks over two ZMQ ROUTER ports and HTTP
(/metrics, /health: scheduler/engine/http_server.py):

* clients: Generate / Abort in; one EngineCoreOutputs per client per step (a
  TokenOutput per request), or a RequestError (scheduler/engine/client_side.py);
* worker: WorkerHello -> WorkerReady -> its acknowledging Heartbeat (the BlockPool
  is built only then), then StepResults (scheduler/engine/worker_side.py, the link's
  state machine in scheduler/engine/worker_link.py);
* steps: schedule -> send the plan -> await its result -> stream tokens out
  (scheduler/engine/step_loop.py);
* watchers: a peer disconnecting on either port is probed at once.

What these parts share (the pool, the policy, the wake-up) is one `EngineState`.

Faults (docs/operations.md): a worker that is gone or silent sends its running
requests back to waiting, as if preempted, and voids the prefix cache; a returning
worker resumes them. With no worker for --worker-reconnect-timeout, waiting
requests end with a RequestError. A client that is gone has its requests aborted.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from functools import partial

import zmq.asyncio

from protocol.speculative_config import parse_speculative_config
from protocol.worker_messages import Shutdown
from scheduler.core.vllm_hashing import make_block_hasher
from scheduler.engine.client_side import ClientSide
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_info import engine_info
from scheduler.engine.engine_state import EngineState
from scheduler.engine.http_server import HttpSide
from scheduler.engine.kv_event_publisher import make_kv_event_sink
from scheduler.engine.metrics import SchedulerMetrics
from scheduler.engine.sockets import open_ports
from scheduler.engine.stats_logger import IterationDetailsLogger, log_stats_every, stats_snapshot
from scheduler.engine.step_loop import StepLoop
from scheduler.engine.worker_link import WorkerLost
from scheduler.engine.worker_side import WorkerSide
from scheduler.sched.request import RequestStatus

log = logging.getLogger("scheduler")
# SIGTERM and SIGINT stop the process.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


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
        iteration_log = IterationDetailsLogger(config.log_stats and config.enable_logging_iteration_details, config.data_parallel_rank)
        self.steps = StepLoop(
            self.state, self.worker, self.client_side, self.metrics, self.kv_event_sink, self.kv_event_publisher,
            config.model_shape, iteration_log, config.worker_reconnect_timeout_s,
        )
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
        step = asyncio.create_task(self.steps.run())
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
        """One batch per step (and per reset): the step loop's. WorkerSide and HttpSide
        are handed this before the step loop exists; they call it on a reset."""
        self.steps.publish_kv_events()
