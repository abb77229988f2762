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
(frontend/admission.py), over the requests in flight here.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import AsyncIterator, Iterable
from typing import Protocol

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.admission import AdmissionControl
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
    def __init__(self, address: str, curve_keys: tuple[str, str] | None = None, admission: AdmissionControl | None = None):
        self.address = address
        self.admission = admission if admission is not None else AdmissionControl()
        self.curve_keys = curve_keys
        self._ctx = zmq.asyncio.Context.instance()
        self._codec: Codec[ClientResponse] = Codec(ClientResponse)
        self._sock: zmq.asyncio.Socket | None = None
        self._sinks: dict[str, OutputSink] = {}
        # Requests sent that the scheduler has not answered yet (no output, no error):
        # the only ones a frame it could not read can have been (`_on_unattributed`).
        self._unheard: dict[str, None] = {}
        self._check: Codec[ClientRequest] = Codec(ClientRequest)
        self._tasks: list[asyncio.Task] = []
        self.num_unrouted = 0

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
                sock.disable_monitor()
                monitor.close(linger=0)
                raise EngineUnreachable(f"cannot reach the scheduler at {self.address} within {timeout:g} s")
            if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                break
        self._tasks = [asyncio.create_task(self._read(), name="engine-client-read"),
                       asyncio.create_task(self._watch(monitor), name="engine-client-watch")]  # fmt: skip

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        self._tasks = []
        if self._sock is not None:
            # NOTE: stop the monitor before the socket closes: otherwise its inproc
            # endpoint (named after the socket's fd, in the shared context) can outlive
            # it, and the next client whose socket gets that fd never hears its events.
            self._sock.disable_monitor()
            self._sock.close(linger=0)
            self._sock = None

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
                    log.error("lost the connection to the scheduler at %s; failing %d requests", self.address, len(self._sinks))
                    sinks, self._sinks = self._sinks, {}
                    self.admission.all_done()
                    for rid, sink in sinks.items():
                        self._deliver_error(rid, sink, EngineError(f"lost the connection to the scheduler at {self.address}"))
        finally:
            monitor.close(linger=0)

    async def _read(self) -> None:
        assert self._sock is not None
        recv, decode, sinks = self._sock.recv_multipart, self._codec.decode, self._sinks
        admission = self.admission
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
                self._unheard.pop(msg.request_id, None)
                sink = sinks.pop(msg.request_id, None)
                if sink is None:
                    log.warning("scheduler error for %s: %s", msg.request_id, msg.message)
                else:
                    admission.prefill_done(msg.request_id)
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
                  message, len(sinks))  # fmt: skip
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
        if self._sock is None:
            return
        for rid in request_ids:
            self._sinks.pop(rid, None)
            self._unheard.pop(rid, None)
            self.admission.prefill_done(rid)
            try:
                self._sock.send(self._codec.encode(Abort(request_id=rid, stopped=stopped)), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("could not abort %s: %s", rid, e)

    async def start(self, request_id: str, prompt_token_ids: list[int], params: dict, sink: OutputSink) -> None:
        """Send one Generate; its outputs go to ``sink`` until the finished one (or an
        error). A caller that stops listening before then calls `abort`."""
        if self._sock is None:
            raise EngineError("the engine client is not connected")
        if request_id in self._sinks:
            raise EngineError(f"request id {request_id!r} is already in flight")
        frame = self._frame(Generate(request_id=request_id, prompt_token_ids=prompt_token_ids, **params))
        self._sinks[request_id] = sink
        self._unheard[request_id] = None
        self.admission.started(request_id, len(prompt_token_ids))
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
