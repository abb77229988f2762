"""The scheduler's client: one zmq DEALER socket, many concurrent streaming requests.

A dispatcher task reads every response frame (one `EngineCoreOutputs` per step, or a
`RequestError`) and routes each `TokenOutput` by `request_id` to that request's
queue; `generate` sends one `Generate`, then reads its queue until the TokenOutput
with finished=True or a RequestError, timing each token.
A request that hears nothing for `request_timeout` seconds is aborted and fails.

`connect` waits for the ZMTP handshake (via a socket monitor) so that an unreachable
scheduler is reported at once instead of requests queueing forever in libzmq. The
same monitor then watches the connection: if the scheduler goes away, every request
in flight fails at once with a clear error instead of waiting for its timeout (a
restarted scheduler would not know them anyway).
"""

from __future__ import annotations

import asyncio
import logging
import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from loadgen.request_result import SUCCESS_FINISH_REASONS, RequestResult, SchedulerUnreachable
from protocol.client_messages import (
    Abort,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec, ProtocolError
from protocol.curve import apply_client

log = logging.getLogger(__name__)

# Put in every request's queue when the connection to the scheduler is lost.
_CONNECTION_LOST = object()


class KVPoolClient:
    """Async client of the scheduler's client port. Use `async with` or connect/close."""

    def __init__(self, address: str, ctx: zmq.asyncio.Context | None = None, curve_keys: tuple[str, str] | None = None):
        self.address = address
        # (own secret certificate, the scheduler's public certificate), for CURVE.
        self.curve_keys = curve_keys
        self._ctx = ctx or zmq.asyncio.Context.instance()
        self._sock: zmq.asyncio.Socket | None = None
        self._codec: Codec[ClientResponse] = Codec(ClientResponse)
        self._queues: dict[str, asyncio.Queue] = {}
        self._dispatcher: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        # Why the connection is gone, once it is; the event lets waiters stop early.
        self.lost: str | None = None
        self._lost_event = asyncio.Event()
        self.num_bad_frames = 0
        self.num_unrouted = 0

    async def __aenter__(self) -> KVPoolClient:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def connect(self, timeout: float) -> None:
        """Connect and wait for the handshake; raise SchedulerUnreachable after `timeout` s."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if self.curve_keys is not None:
            apply_client(sock, *self.curve_keys)
        monitor = sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_CONNECT_RETRIED | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._sock = sock
        sock.connect(self.address)
        retries = 0
        deadline = time.monotonic() + timeout
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not await monitor.poll(left * 1000):
                    raise SchedulerUnreachable(
                        f"cannot reach the scheduler at {self.address}: no connection within "
                        f"{timeout:g} s ({retries} connection attempts refused or unanswered); "
                        "is `python -m scheduler` running on that port?"
                    )
                message = parse_monitor_message(await monitor.recv_multipart())
                event = message["event"]
                if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                    break
                # NOTE: a handshake that failed will fail again: say why at once.
                refused = self._handshake_refused(event, message["value"])
                if refused is not None:
                    raise SchedulerUnreachable(refused)
                retries += 1
        except BaseException:
            sock.disable_monitor()
            monitor.close(linger=0)
            raise
        self._dispatcher = asyncio.create_task(self._dispatch(), name="loadgen-dispatcher")
        self._watcher = asyncio.create_task(self._watch(monitor), name="loadgen-connection-watch")

    def _handshake_refused(self, event: int, value: int) -> str | None:
        """Why the scheduler refused the handshake, naming the flags that fix it
        (None: not a refusal)."""
        if event == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL and value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
            if self.curve_keys is None:
                return (f"the scheduler at {self.address} requires CURVE authentication: give "
                        "--curve-client-key (this client's NAME.key_secret) and --curve-server-key (the "
                        "scheduler's public .key)")
            return f"the scheduler at {self.address} does not use CURVE: drop --curve-client-key and --curve-server-key"
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            return (f"the scheduler at {self.address} refused this client's CURVE key (status {value}): is its "
                    "public .key in the scheduler's --curve-authorized-keys folder, and --curve-server-key the "
                    "scheduler's?")
        return None

    async def _watch(self, monitor: zmq.asyncio.Socket) -> None:
        try:
            while True:
                event = parse_monitor_message(await monitor.recv_multipart())["event"]
                if event == zmq.EVENT_DISCONNECTED:
                    self.lost = f"lost the connection to the scheduler at {self.address} (did it stop?)"
                    self._lost_event.set()
                    log.error("%s; failing %d requests in flight", self.lost, len(self._queues))
                    for queue in self._queues.values():
                        queue.put_nowait(_CONNECTION_LOST)
                    return
        finally:
            if self._sock is not None:
                self._sock.disable_monitor()
            monitor.close(linger=0)

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            try:
                await self._watcher
            except asyncio.CancelledError:
                pass
            self._watcher = None
        if self._dispatcher is not None:
            self._dispatcher.cancel()
            try:
                await self._dispatcher
            except asyncio.CancelledError:
                pass
            self._dispatcher = None
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    async def _dispatch(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart()
            try:
                # NOTE: one frame per message; take the last in case a ROUTER peer
                # adds an empty delimiter frame (REQ-style envelope).
                msg = self._codec.decode(frames[-1])
            except ProtocolError as e:
                self.num_bad_frames += 1
                log.warning("unreadable frame from the scheduler: %s", e)
                continue
            if isinstance(msg, EngineCoreOutputs):
                queues = self._queues
                for out in msg.outputs:
                    queue = queues.get(out.request_id)
                    if queue is None:
                        self.num_unrouted += 1
                    else:
                        queue.put_nowait(out)
                continue
            queue = self._queues.get(msg.request_id) if msg.request_id is not None else None
            if queue is None:
                self.num_unrouted += 1
                log.warning("scheduler error for %s: %s", msg.request_id, msg.message)
                continue
            queue.put_nowait(msg)

    async def abort(self, request_ids: list[str] | None = None) -> None:
        """Ask the scheduler to stop these requests (default: every one in flight)."""
        if self._sock is None:
            return
        ids = list(self._queues) if request_ids is None else request_ids
        for rid in ids:
            await self._sock.send(self._codec.encode(Abort(request_id=rid)))

    async def sleep_unless_lost(self, seconds: float) -> None:
        """Sleep, but wake as soon as the connection to the scheduler is lost."""
        try:
            await asyncio.wait_for(self._lost_event.wait(), seconds)
        except TimeoutError:
            pass

    @property
    def in_flight(self) -> list[str]:
        return list(self._queues)

    async def generate(
        self,
        index: int,
        request_id: str,
        prompt_token_ids: list[int],
        max_tokens: int,
        ignore_eos: bool,
        request_timeout: float,
    ) -> RequestResult:
        """Send one request and stream its tokens until it finishes or fails."""
        if self._sock is None or self._dispatcher is None:
            raise RuntimeError("connect() first")
        if request_id in self._queues:
            raise ValueError(f"request id {request_id!r} already in flight")
        res = RequestResult(index, request_id, len(prompt_token_ids))
        if self.lost is not None:
            res.error = self.lost
            return res
        queue: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = queue
        msg = Generate(
            request_id=request_id,
            prompt_token_ids=prompt_token_ids,
            max_tokens=max_tokens,
            ignore_eos=ignore_eos,
        )
        try:
            res.start_s = time.perf_counter()
            await self._sock.send(self._codec.encode(msg))
            await self._read_replies(queue, res, request_timeout)
        finally:
            self._queues.pop(request_id, None)
        return res

    async def _read_replies(self, queue: asyncio.Queue, res: RequestResult, request_timeout: float) -> None:
        """Fill ``res`` from one request's replies, timing each token, until its last one,
        a refusal, the loss of the connection, or ``request_timeout`` seconds without a
        reply (then the request is aborted)."""
        last_token_s = res.start_s
        while True:
            try:
                reply = await asyncio.wait_for(queue.get(), request_timeout)
            except TimeoutError:
                res.error = f"no response from the scheduler for {request_timeout:g} s"
                await self.abort([res.request_id])
                return
            if reply is _CONNECTION_LOST:
                res.error = self.lost
                return
            now = time.perf_counter()
            res.latency_s = now - res.start_s
            if isinstance(reply, RequestError):
                res.error = f"rejected by the scheduler: {reply.message}"
                return
            assert isinstance(reply, TokenOutput)
            res.num_cached_tokens = max(res.num_cached_tokens, reply.num_cached_tokens)
            if reply.new_token_ids:
                if res.ttft_s is None:
                    res.ttft_s = now - res.start_s
                else:
                    res.itl_s.append(now - last_token_s)
                last_token_s = now
                res.token_ids.extend(reply.new_token_ids)
            if reply.finished:
                res.finish_reason = reply.finish_reason
                res.success = reply.finish_reason in SUCCESS_FINISH_REASONS
                if not res.success:
                    res.error = f"finished with reason {reply.finish_reason!r}"
                return
