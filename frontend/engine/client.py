"""The frontend's client of the scheduler's client port (vLLM's ``EngineCoreClient``):
one ZMQ DEALER, many concurrent requests.

A reader task routes every TokenOutput by request id to its request's sink, called
right there, in the reader's pass over the step's outputs (`start`): a streaming
response turns the output into its SSE chunk and writes it without waking its own
task. `generate` is the same over a queue: an async iterator of the TokenOutputs. How
a response frame is read is in one place, `token_outputs`. A request left before its
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
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.engine.admission import AdmissionControl
from frontend.engine.resume import ResumeBook
from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec, ProtocolError
from protocol.curve import apply_client

log = logging.getLogger(__name__)

# How often a client that lost its scheduler asks whether it is back.
RECOVERY_POLL_S = 0.1

class EngineError(RuntimeError):
    """The scheduler refused a request (``RequestError``, with the field it names as
    ``param``) or could not be reached."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class OutputSink(Protocol):
    """Where one engine request's outputs go, called from the reader task: an output
    (its last one has ``finished``), or the error that ends the request. Neither may
    block; after ``on_error`` or the finished output nothing more comes."""

    def on_output(self, out: TokenOutput) -> None: ...

    def on_error(self, error: EngineError) -> None: ...


class _QueueSink:
    __slots__ = ("queue",)

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_output(self, out: TokenOutput) -> None:
        self.queue.put_nowait(out)

    def on_error(self, error: EngineError) -> None:
        self.queue.put_nowait(error)


class EngineUnreachable(EngineError):
    """No connection to the scheduler's client port in time."""


def token_outputs(msg: ClientResponse) -> Iterable[TokenOutput]:
    """The TokenOutputs one response frame carries: the batch of a step
    (``EngineCoreOutputs.outputs``), or a lone TokenOutput."""
    outputs = getattr(msg, "outputs", None)
    return (msg,) if outputs is None else outputs


class EngineClient:
    def __init__(self, address: str, curve_keys: tuple[str, str] | None = None, admission: AdmissionControl | None = None,
                 restart_timeout_s: float = 0.0, scheduler_ready: Callable[[], Awaitable[bool]] | None = None):
        self.address = address
        self.restart_timeout_s = restart_timeout_s
        # One probe of the scheduler's readiness (None: connected is ready).
        self.scheduler_ready = scheduler_ready
        # Every request in flight, to give again to a scheduler that came back.
        self._book = ResumeBook()
        # While the scheduler is away: the recovery task (requests are held, not sent).
        self._recovery: asyncio.Task | None = None
        self.admission = admission if admission is not None else AdmissionControl()
        self.curve_keys = curve_keys
        self._ctx = zmq.asyncio.Context.instance()
        self._codec: Codec[ClientResponse] = Codec(ClientResponse)
        self._sock: zmq.asyncio.Socket | None = None
        self._monitor: zmq.asyncio.Socket | None = None
        self._sinks: dict[str, OutputSink] = {}
        # Requests sent that the scheduler has not answered yet (no output, no error):
        # the only ones a frame it could not read can have been (`_on_unattributed`).
        self._unheard: dict[str, None] = {}
        self._check: Codec[ClientRequest] = Codec(ClientRequest)
        self._tasks: list[asyncio.Task] = []
        self.num_unrouted = 0
        self.stopping = False  # `end_all` was called: no request starts any more

    @property
    def num_in_flight(self) -> int:
        return len(self._sinks)

    def check_admission(self, n: int = 1) -> None:
        """vLLM's AsyncLLM.check_admission: raises AdmissionRejected (an APIError, 503)
        if ``n`` more engine requests would pass a queue limit."""
        self.admission.check(len(self._sinks), n)

    def check_admission_prompts(self, prompt_lens: list[int], n: int) -> None:
        """The same as the engine requests start: prompt by prompt (`AdmissionControl.check_prompts`)."""
        self.admission.check_prompts(len(self._sinks), prompt_lens, n)

    async def connect(self, timeout: float) -> None:
        await self._connect(timeout)
        self._start_tasks()

    def _start_tasks(self) -> None:
        """The reader and the connection's watcher, on the socket just connected."""
        self._tasks = [asyncio.create_task(self._read(), name="engine-client-read"),
                       asyncio.create_task(self._watch(), name="engine-client-watch")]

    async def _connect(self, timeout: float) -> None:
        """A new socket connected to the scheduler; EngineUnreachable if not within ``timeout``."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_keys is not None:
            apply_client(sock, *self.curve_keys)
        monitor = sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED)
        sock.connect(self.address)
        self._sock = sock
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await monitor.poll(left * 1000):
                self._close_socket()
                raise EngineUnreachable(f"cannot reach the scheduler at {self.address} within {timeout:g} s")
            if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
        self._monitor = monitor

    def end_all(self) -> None:
        """The frontend is stopping: every request in flight ends now with finish reason
        "abort" (aborted at the scheduler), as the scheduler's own stop ends its running
        ones and vLLM's --shutdown-timeout 0 does; later ones are refused. Otherwise a stop
        waits on each open response until its request ends, or, held for a scheduler that
        is restarting, for ever."""
        self.stopping = True
        for rid, sink in list(self._sinks.items()):
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
        if self._sock is not None:
            # NOTE: stop the monitor before the socket closes: otherwise its inproc
            # endpoint (named after the socket's fd, in the shared context) can outlive
            # it, and the next client whose socket gets that fd never hears its events.
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None
        if self._monitor is not None:
            self._monitor.close(linger=0)
            self._monitor = None

    async def _watch(self) -> None:
        while True:
            if parse_monitor_message(await self._monitor.recv_multipart())["event"] != zmq.EVENT_DISCONNECTED:
                continue
            if self.restart_timeout_s <= 0:
                log.error("lost the connection to the scheduler at %s; failing %d requests", self.address, len(self._sinks))
                self._fail(list(self._sinks), EngineError(f"lost the connection to the scheduler at {self.address}"))
                continue
            log.warning("lost the connection to the scheduler at %s; holding %d requests for up to %g s while it comes back",
                        self.address, len(self._sinks), self.restart_timeout_s)
            self._recovery = asyncio.create_task(self._recover(), name="engine-client-recover")
            return  # NOTE: the recovery starts a new reader and watcher on the new socket

    def _forget(self, request_id: str) -> OutputSink | None:
        """Drop every record of a request that ends here (its sink, returned)."""
        self._unheard.pop(request_id, None)
        self._book.forget(request_id)
        self.admission.prefill_done(request_id)
        return self._sinks.pop(request_id, None)

    def _fail(self, request_ids: list[str], error: EngineError) -> None:
        for rid in request_ids:
            if (sink := self._forget(rid)) is not None:
                self._deliver_error(rid, sink, error)

    async def _recover(self) -> None:
        """Reconnect, wait for the scheduler to be ready, give it every request in flight."""
        lost = time.monotonic()
        for kept in self._book.kept.values():
            kept.waiting_since = lost
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
        self._unheard.clear()
        ids = list(self._book.kept)  # NOTE: kept and forgotten with the sinks, so every request in flight
        log.warning("the scheduler at %s is back after %.1f s; resuming %d requests", self.address, time.monotonic() - lost, len(ids))
        for rid in ids:
            self._unheard[rid] = None
            self._book.kept[rid].waiting_since = None
            await self._sock.send(self._frame(self._book.generate(rid)))
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
        now, limit = time.monotonic(), self.restart_timeout_s
        expired = [rid for rid, k in self._book.kept.items() if k.waiting_since is not None and now - k.waiting_since > limit]
        if expired:
            self._fail(expired, EngineError(f"lost the connection to the scheduler at {self.address}, "
                                            f"and it did not come back within {limit:g} s"))

    async def _read(self) -> None:
        assert self._sock is not None
        recv, decode, sinks = self._sock.recv_multipart, self._codec.decode, self._sinks
        admission, kept = self.admission, self._book.kept
        prefilling = admission.prefilling  # NOTE: None without --max-num-queued-tokens
        while True:
            frames = await recv()
            try:
                msg = decode(frames[-1])
            except ProtocolError as e:
                log.warning("unreadable frame from the scheduler: %s", e)
                continue
            if isinstance(msg, RequestError):
                if msg.request_id is None:
                    self._on_unattributed(msg.message)
                    continue
                sink = self._forget(msg.request_id)
                if sink is None:
                    log.warning("scheduler error for %s: %s", msg.request_id, msg.message)
                else:
                    self._deliver_error(msg.request_id, sink, EngineError(msg.message, msg.param))
                continue
            unheard = self._unheard
            for out in token_outputs(msg):
                rid = out.request_id
                if unheard:
                    unheard.pop(rid, None)
                sink = sinks.get(rid)
                if sink is None:
                    self.num_unrouted += 1  # e.g. the last output of a request aborted here
                    continue
                if prefilling and rid in prefilling:
                    admission.prefill_done(rid)  # its first output: out of prefill, as vLLM's is_prefilling
                if out.finished:
                    del sinks[rid]
                    kept.pop(rid, None)
                elif out.new_token_ids:
                    kept[rid].outputs += out.new_token_ids
                try:
                    sink.on_output(out)
                except Exception:  # noqa: BLE001 - one request's failure must not stop the reader
                    log.exception("the sink of %s failed; aborting it", rid)
                    if not out.finished:
                        self.abort([rid])
                    self._deliver_error(rid, sink, EngineError("internal error while streaming the request"))

    def _on_unattributed(self, message: str) -> None:
        """A refusal naming no request: the scheduler could not read one of this
        client's frames far enough to know its request id. It can only be a request
        not answered yet; which one cannot be told, so every such request fails now
        rather than wait for an answer that will never come.

        NOTE: not expected from this client: every Generate is checked against the
        scheduler's decoder before it goes (`start`), and the scheduler names the
        request of any frame that is a map with a request id."""
        sinks = {rid: self._sinks.pop(rid) for rid in self._unheard if rid in self._sinks}
        log.error("the scheduler refused a frame it could not read (%s); failing the %d requests it had not answered",
                  message, len(sinks))
        self._unheard.clear()
        self.abort(sinks)  # NOTE: any of them it did read would otherwise run on, holding blocks
        error = EngineError(f"the scheduler could not read a request: {message}")
        for rid, sink in sinks.items():
            self._deliver_error(rid, sink, error)

    @staticmethod
    def _deliver_error(rid: str, sink: OutputSink, error: EngineError) -> None:
        try:
            sink.on_error(error)
        except Exception:  # noqa: BLE001
            log.exception("the sink of %s failed on an error", rid)

    def abort(self, request_ids: Iterable[str], stopped: bool = False) -> None:
        """Abort without waiting (a DEALER send does not block below its HWM).
        ``stopped``: a stop string ended them (the scheduler counts them finished)."""
        for rid in request_ids:
            self._forget(rid)
            if self._sock is None or self._recovery is not None:
                continue  # NOTE: the scheduler that had it is gone; it is not given again
            try:
                self._sock.send(self._codec.encode(Abort(request_id=rid, stopped=stopped)), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("could not abort %s: %s", rid, e)

    async def start(self, request_id: str, prompt_token_ids: list[int], params: dict, sink: OutputSink) -> None:
        """Send one Generate; its outputs go to ``sink`` until the finished one (or an
        error). A caller that stops listening before then calls `abort`."""
        if self._sock is None and self._recovery is None:
            raise EngineError("the engine client is not connected")
        if self.stopping:
            raise EngineError("the server is stopping")
        if request_id in self._sinks:
            raise EngineError(f"request id {request_id!r} is already in flight")
        frame = self._frame(Generate(request_id=request_id, prompt_token_ids=prompt_token_ids, **params))
        self._sinks[request_id] = sink
        kept = self._book.track(request_id, prompt_token_ids, params)
        self.admission.started(request_id, len(prompt_token_ids))
        if self._recovery is not None:
            kept.waiting_since = time.monotonic()  # NOTE: held; the recovery gives it to the scheduler that comes back
            return
        self._unheard[request_id] = None
        try:
            await self._sock.send(frame)
        except BaseException:
            self.abort([request_id])  # NOTE: cancelled mid-send, the Generate may have gone
            raise

    def _frame(self, msg: Generate) -> bytes:
        """The Generate's frame, read back with the scheduler's own decoder first: a
        field the wire cannot carry is refused here, naming it, and never leaves."""
        try:
            frame = self._codec.encode(msg)
            self._check.decode(frame)
        except (ProtocolError, OverflowError, TypeError) as e:
            raise EngineError(f"the request cannot be sent to the engine: {e}", _field_of(str(e))) from None
        return frame

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: dict) -> AsyncIterator[TokenOutput]:
        """Send one Generate; yield its TokenOutputs until the finished one."""
        sink = _QueueSink()
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
            if not done and request_id in self._sinks:  # not aborted already (a stop string)
                self.abort([request_id])


def _field_of(message: str) -> str | None:
    """The top-level field a msgspec error names (``... - at `$.stop_token_ids[0]```)."""
    at = message.rfind("`$.")
    return re.split(r"[\[.`]", message[at + 3:], maxsplit=1)[0] or None if at >= 0 else None
