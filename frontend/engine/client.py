"""The frontend's client of the scheduler's client port (vLLM's ``EngineCoreClient``):
one ZMQ DEALER, many concurrent requests.

A reader task routes every TokenOutput by request id to its request's sink, called
right there, in the reader's pass over the step's outputs (`start`): a streaming
response turns the output into its SSE chunk and writes it without waking its own
task. `generate` is the same over a queue: an async iterator of the TokenOutputs
(frontend/engine/outputs.py). A request left before its
last output (a stop string, a client gone, an error) is aborted at once, so its KV
blocks are freed. A lost connection fails every request in flight; ZeroMQ reconnects
by itself and later requests go through. `check_admission` is vLLM's queue limits
(frontend/engine/admission.py), over the requests in flight here.

A lost connection is a scheduler that died (and that ``kvpool serve`` restarts), unless
``restart_timeout_s`` is 0: then every request in flight fails at once. Otherwise
nothing fails yet: the client drops its socket (and what was queued on it), connects a
new one, waits until the scheduler says it is ready (``scheduler_ready``: its /health,
once a worker has registered again) and gives it every request in flight again, each
with the outputs it already streamed (frontend/engine/resume.py), so that it resumes as
a preempted request resumes. Requests started meanwhile wait and go with them. One that
waits longer than ``restart_timeout_s`` (from the loss, or from its start if later) fails
with a 503.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import zmq
import zmq.asyncio

from frontend.engine.admission import AdmissionControl
from frontend.engine.generate_frames import GenerateFrames
from frontend.engine.in_flight import InFlight
from frontend.engine.outputs import (
    EngineError,
    EngineUnreachable,
    OutputSink,
    QueueSink,
    token_outputs,
)
from frontend.engine.scheduler_socket import SchedulerSocket
from protocol.client_messages import Abort, ClientResponse, Generate, RequestError, TokenOutput
from protocol.codec import Codec, ProtocolError

log = logging.getLogger(__name__)

# How often a client that lost its scheduler asks whether it is back.
RECOVERY_POLL_S = 0.1


class EngineClient:
    def __init__(self, address: str, curve_keys: tuple[str, str] | None = None, admission: AdmissionControl | None = None,
                 restart_timeout_s: float = 0.0, scheduler_ready: Callable[[], Awaitable[bool]] | None = None):
        self.address = address
        self.restart_timeout_s = restart_timeout_s
        # One probe of the scheduler's readiness (None: connected is ready).
        self.scheduler_ready = scheduler_ready
        # While the scheduler is away: the recovery task (requests are held, not sent).
        self._recovery: asyncio.Task | None = None
        self.admission = admission if admission is not None else AdmissionControl()
        # Every request in flight: its sink, and what gives it again to a scheduler that came back.
        self.in_flight = InFlight(self.admission)
        self.curve_keys = curve_keys
        self._ctx = zmq.asyncio.Context.instance()
        self._codec: Codec[ClientResponse] = Codec(ClientResponse)
        self._frames = GenerateFrames(self._codec)
        self._conn: SchedulerSocket | None = None
        self._tasks: list[asyncio.Task] = []
        self.stopping = False  # `end_all` was called: no request starts any more

    @property
    def num_in_flight(self) -> int:
        return len(self.in_flight)

    def check_admission(self, n: int = 1) -> None:
        """vLLM's AsyncLLM.check_admission: raises AdmissionRejected (an APIError, 503)
        if ``n`` more engine requests would pass a queue limit."""
        self.admission.check(len(self.in_flight), n)

    def check_admission_prompts(self, prompt_lens: list[int], n: int) -> None:
        """The same as the engine requests start: prompt by prompt (`AdmissionControl.check_prompts`)."""
        self.admission.check_prompts(len(self.in_flight), prompt_lens, n)

    async def connect(self, timeout: float) -> None:
        await self._connect(timeout)
        self._start_tasks()

    def _start_tasks(self) -> None:
        """The reader and the connection's watcher, on the socket just connected."""
        self._tasks = [asyncio.create_task(self._read(), name="engine-client-read"),
                       asyncio.create_task(self._watch(), name="engine-client-watch")]

    async def _connect(self, timeout: float) -> None:
        self._conn = await SchedulerSocket.connect(self._ctx, self.address, self.curve_keys, timeout)

    def end_all(self) -> None:
        """The frontend is stopping: every request in flight ends now with finish reason
        "abort" (aborted at the scheduler), as the scheduler's own stop ends its running
        ones and vLLM's --shutdown-timeout 0 does; later ones are refused. Otherwise a stop
        waits on each open response until its request ends, or, held for a scheduler that
        is restarting, for ever."""
        self.stopping = True
        for rid, sink in list(self.in_flight.sinks.items()):
            self.abort([rid])
            try:
                sink.on_output(TokenOutput(request_id=rid, new_token_ids=[], finished=True, finish_reason="abort"))
            except Exception:  # noqa: BLE001 - one request's failure must not keep the others open
                log.exception("the sink of %s failed on its abort", rid)

    async def close(self) -> None:
        tasks = [*self._tasks, *([self._recovery] if self._recovery is not None else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        self._recovery = None
        self._close_socket()

    def _close_socket(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _watch(self) -> None:
        while True:
            if await self._conn.next_event() != zmq.EVENT_DISCONNECTED:
                continue
            if self.restart_timeout_s <= 0:
                log.error("lost the connection to the scheduler at %s; failing %d requests", self.address, len(self.in_flight))
                self.in_flight.fail(list(self.in_flight.sinks), EngineError(f"lost the connection to the scheduler at {self.address}"))
                continue
            log.warning("lost the connection to the scheduler at %s; holding %d requests for up to %g s while it comes back",
                        self.address, len(self.in_flight), self.restart_timeout_s)
            self._recovery = asyncio.create_task(self._recover(), name="engine-client-recover")
            return  # NOTE: the recovery starts a new reader and watcher on the new socket

    async def _recover(self) -> None:
        """Reconnect, wait for the scheduler to be ready, give it every request in flight."""
        lost = time.monotonic()
        self.in_flight.book.hold_all(lost)
        reader = self._tasks[0] if self._tasks else None
        if reader is not None:
            reader.cancel()
            await asyncio.gather(reader, return_exceptions=True)
        self._tasks = []
        self._close_socket()
        while True:
            self._fail_expired()
            try:
                await self._connect(RECOVERY_POLL_S * 10)
            except EngineUnreachable:
                continue
            if await self._wait_ready():
                break
            self._close_socket()  # NOTE: connected but never ready: try a fresh socket
        book, unheard = self.in_flight.book, self.in_flight.unheard
        unheard.clear()
        ids = list(book.kept)  # NOTE: kept and forgotten with the sinks, so every request in flight
        log.warning("the scheduler at %s is back after %.1f s; resuming %d requests", self.address, time.monotonic() - lost, len(ids))
        for rid in ids:
            unheard[rid] = None
            book.kept[rid].waiting_since = None
            await self._conn.sock.send(self._frames.frame(book.generate(rid)))
        self._start_tasks()
        self._recovery = None

    async def _wait_ready(self) -> bool:
        """True once the scheduler says it is ready; False after a while (to reconnect)."""
        if self.scheduler_ready is None:
            return True
        for _ in range(50):
            self._fail_expired()
            try:
                if await self.scheduler_ready():
                    return True
            except Exception as e:  # noqa: BLE001 - any failure of the probe is "not ready yet"
                log.debug("the scheduler's readiness probe failed: %s", e)
            await asyncio.sleep(RECOVERY_POLL_S)
        return False

    def _fail_expired(self) -> None:
        """Fail the requests that waited longer than restart_timeout_s for the scheduler."""
        limit = self.restart_timeout_s
        if expired := self.in_flight.book.expired(time.monotonic(), limit):
            self.in_flight.fail(expired, EngineError(f"lost the connection to the scheduler at {self.address}, "
                                            f"and it did not come back within {limit:g} s"))

    async def _read(self) -> None:
        recv, decode, in_flight = self._conn.sock.recv_multipart, self._codec.decode, self.in_flight
        while True:
            frames = await recv()
            try:
                msg = decode(frames[-1])
            except ProtocolError as e:
                log.warning("unreadable frame from the scheduler: %s", e)
                continue
            if isinstance(msg, RequestError):
                in_flight.refused(msg, self.abort)
            else:
                in_flight.route(token_outputs(msg), self.abort)

    def abort(self, request_ids: Iterable[str], stopped: bool = False) -> None:
        """Abort without waiting (a DEALER send does not block below its HWM).
        ``stopped``: a stop string ended them (the scheduler counts them finished)."""
        for rid in request_ids:
            self.in_flight.forget(rid)
            if self._conn is None or self._recovery is not None:
                continue  # NOTE: the scheduler that had it is gone; it is not given again
            try:
                self._conn.sock.send(self._codec.encode(Abort(request_id=rid, stopped=stopped)), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("could not abort %s: %s", rid, e)

    async def start(self, request_id: str, prompt_token_ids: list[int], params: dict, sink: OutputSink) -> None:
        """Send one Generate; its outputs go to ``sink`` until the finished one (or an
        error). A caller that stops listening before then calls `abort`."""
        if self._conn is None and self._recovery is None:
            raise EngineError("the engine client is not connected")
        if self.stopping:
            raise EngineError("the server is stopping")
        if request_id in self.in_flight:
            raise EngineError(f"request id {request_id!r} is already in flight")
        frame = self._frames.frame(Generate(request_id=request_id, prompt_token_ids=prompt_token_ids, **params))
        kept = self.in_flight.add(request_id, prompt_token_ids, params, sink)
        if self._recovery is not None:
            kept.waiting_since = time.monotonic()  # NOTE: held; the recovery gives it to the scheduler that comes back
            return
        self.in_flight.unheard[request_id] = None
        try:
            await self._conn.sock.send(frame)
        except BaseException:
            self.abort([request_id])  # NOTE: cancelled mid-send, the Generate may have gone
            raise

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: dict) -> AsyncIterator[TokenOutput]:
        """Send one Generate; yield its TokenOutputs until the finished one."""
        sink = QueueSink()
        await self.start(request_id, prompt_token_ids, params, sink)
        done = False
        try:
            while True:
                out = await sink.queue.get()
                if isinstance(out, EngineError):
                    done = True
                    raise out
                done = out.finished
                yield out
                if done:
                    return
        finally:
            if not done and request_id in self.in_flight:  # not aborted already (a stop string)
                self.abort([request_id])

