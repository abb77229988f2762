"""The frontend's client of the scheduler's client port (vLLM's ``EngineCoreClient``):
one ZMQ DEALER, many concurrent requests, each an async iterator of its TokenOutputs.

A reader task routes every TokenOutput by request id to its request's queue. How a
response frame is read is in one place, `token_outputs`. A request whose iterator is
left before its last output (a stop string, a client gone, an error) is aborted at
once, so its KV blocks are freed. A lost connection fails every request in flight;
ZeroMQ reconnects by itself and later requests go through.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Iterable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from protocol.client_messages import Abort, ClientResponse, Generate, RequestError, TokenOutput
from protocol.codec import Codec, ProtocolError
from protocol.curve import apply_client

log = logging.getLogger(__name__)

_LOST = object()


class EngineError(RuntimeError):
    """The scheduler refused a request (``RequestError``) or could not be reached."""


class EngineUnreachable(EngineError):
    """No connection to the scheduler's client port in time."""


def token_outputs(msg: ClientResponse) -> Iterable[TokenOutput]:
    """The TokenOutputs one response frame carries: the batch of a step
    (``EngineCoreOutputs.outputs``), or a lone TokenOutput."""
    outputs = getattr(msg, "outputs", None)
    return (msg,) if outputs is None else outputs


class EngineClient:
    def __init__(self, address: str, curve_keys: tuple[str, str] | None = None):
        self.address = address
        self.curve_keys = curve_keys
        self._ctx = zmq.asyncio.Context.instance()
        self._codec: Codec[ClientResponse] = Codec(ClientResponse)
        self._sock: zmq.asyncio.Socket | None = None
        self._queues: dict[str, asyncio.Queue] = {}
        self._tasks: list[asyncio.Task] = []
        self.num_unrouted = 0

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

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
            self._sock.close(linger=0)
            self._sock = None

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                if parse_monitor_message(await monitor.recv_multipart())["event"] == zmq.EVENT_DISCONNECTED:
                    log.error("lost the connection to the scheduler at %s; failing %d requests", self.address, len(self._queues))
                    for queue in self._queues.values():
                        queue.put_nowait(_LOST)
        finally:
            monitor.close(linger=0)

    async def _read(self) -> None:
        assert self._sock is not None
        recv, decode, queues = self._sock.recv_multipart, self._codec.decode, self._queues
        while True:
            frames = await recv()
            try:
                msg = decode(frames[-1])
            except ProtocolError as e:
                log.warning("unreadable frame from the scheduler: %s", e)
                continue
            if isinstance(msg, RequestError):
                queue = queues.get(msg.request_id) if msg.request_id is not None else None
                if queue is None:
                    log.warning("scheduler error for %s: %s", msg.request_id, msg.message)
                else:
                    queue.put_nowait(msg)
                continue
            for out in token_outputs(msg):
                queue = queues.get(out.request_id)
                if queue is None:
                    self.num_unrouted += 1  # e.g. the last output of a request aborted here
                else:
                    queue.put_nowait(out)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Abort without waiting (a DEALER send does not block below its HWM)."""
        if self._sock is None:
            return
        for rid in request_ids:
            self._queues.pop(rid, None)
            try:
                self._sock.send(self._codec.encode(Abort(request_id=rid)), zmq.NOBLOCK)
            except zmq.ZMQError as e:
                log.warning("could not abort %s: %s", rid, e)

    async def generate(self, request_id: str, prompt_token_ids: list[int], params: dict) -> AsyncIterator[TokenOutput]:
        """Send one Generate; yield its TokenOutputs until the finished one."""
        if self._sock is None:
            raise EngineError("the engine client is not connected")
        if request_id in self._queues:
            raise EngineError(f"request id {request_id!r} is already in flight")
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        done = False
        try:
            await self._sock.send(self._codec.encode(Generate(request_id=request_id, prompt_token_ids=prompt_token_ids, **params)))
            while True:
                out = await queue.get()
                if out is _LOST:
                    done = True
                    raise EngineError(f"lost the connection to the scheduler at {self.address}")
                if isinstance(out, RequestError):
                    done = True
                    raise EngineError(out.message)
                if out.finished:
                    done = True
                yield out
                if done:
                    return
        finally:
            if done:
                self._queues.pop(request_id, None)
            else:
                self.abort([request_id])
