"""The scheduler's two ROUTER sockets, with liveness.

ZeroMQ hides connections, but two things show them: a monitor socket reports
that *some* peer disconnected, and a ROUTER with ROUTER_MANDATORY refuses a send
to a peer that is gone (EHOSTUNREACH). `RouterPort.send` never waits: a peer that
is gone, or that has stopped reading (send queue full), makes it return False, and
the caller decides what that peer's requests become.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils.monitor import parse_monitor_message

from protocol.curve import apply_server
from scheduler.engine.config import SchedulerConfig

log = logging.getLogger("scheduler")

# Frames of one message that `RouterPort.recv` keeps: the peer's identity and one
# payload frame, plus one to show there were more. The rest are counted and dropped.
MAX_KEPT_FRAMES = 3
# While dropping the frames of an oversized multi-part message, yield every so often.
_YIELD_EVERY_FRAMES = 4096
# A receive loop yields to the other tasks (steps, heartbeats, HTTP) after this long.
YIELD_INTERVAL_S = 0.002


def peer_name(ident: bytes | None) -> str:
    """A ZeroMQ routing id as logs show it: hex (ROUTER's own ids are 5 raw bytes)."""
    return "-" if ident is None else ident.hex()


class LoopYield:
    """Bounds how long a receive loop runs without letting other tasks in.

    NOTE: pyzmq hands back an already-completed future when a frame is queued, and
    awaiting a done future does not yield: a loop draining 1,000 queued frames
    (each hashed on arrival) would otherwise starve the step loop, heartbeats and
    /health until the queue is empty.
    """

    __slots__ = ("interval_s", "_since")

    def __init__(self, interval_s: float = YIELD_INTERVAL_S):
        self.interval_s = interval_s
        self._since = time.perf_counter()

    async def __call__(self) -> None:
        if time.perf_counter() - self._since >= self.interval_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


class RouterPort:
    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        address: str,
        *,
        rcvhwm: int = 10_000,
        sndhwm: int = 100_000,
        max_msg_size: int = -1,
        curve_secret_key: str | None = None,
        heartbeat_timeout_ms: int = 1500,
    ):
        sock = ctx.socket(zmq.ROUTER)
        if curve_secret_key is not None:
            apply_server(sock, curve_secret_key)
        sock.setsockopt(zmq.LINGER, 1000)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        sock.setsockopt(zmq.RCVHWM, rcvhwm)
        sock.setsockopt(zmq.SNDHWM, sndhwm)
        # A peer sending a frame over this size is disconnected by ZeroMQ itself,
        # before the frame is buffered: memory stays bounded whatever is sent.
        sock.setsockopt(zmq.MAXMSGSIZE, max_msg_size)
        # ZMTP heartbeats are answered by ZeroMQ's I/O thread, so a peer that is busy
        # computing still answers; a dead or cut-off one is dropped within the timeout.
        # NOTE: a PING queues behind data: a peer that stops reading while data flows
        # to it cannot answer, and is dropped too. Clients get a lenient timeout.
        sock.setsockopt(zmq.HEARTBEAT_IVL, min(500, heartbeat_timeout_ms // 3))
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, heartbeat_timeout_ms)
        sock.bind(address)
        self.sock = sock
        # Plain (blocking-API) view of the same socket, for the frames after the first.
        self._sync = zmq.Socket.shadow(sock.underlying)
        self._monitor = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    async def recv(self) -> tuple[list[zmq.Frame], int]:
        """One message: its first frames (the peer's identity first; at most
        MAX_KEPT_FRAMES of them) and the number of frames it had.

        NOTE: MAXMSGSIZE bounds each frame, not how many one message has: a million
        empty frames are 2 MB on the wire. recv_multipart held them all as Python
        objects (and blocked the loop long enough to lose the worker). Frames past
        the first few are read and dropped one at a time here.
        """
        first = await self.sock.recv(copy=False)
        frames = [first]
        num_frames = 1
        more = first.more
        sync = self._sync
        while more:
            try:
                frame = sync.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:  # not expected: libzmq delivers a message once all of it is in
                frame = await self.sock.recv(copy=False)
            num_frames += 1
            more = frame.more
            if len(frames) < MAX_KEPT_FRAMES:
                frames.append(frame)
            elif num_frames % _YIELD_EVERY_FRAMES == 0:
                await asyncio.sleep(0)
        return frames, num_frames

    def has_pending(self) -> bool:
        """A message is queued, not yet received.

        NOTE: ``get`` on the asyncio socket, which re-arms its own reader after reading
        ZMQ_EVENTS (edge-triggered: a bare read could swallow the wake-up of recv)."""
        return bool(self.sock.get(zmq.EVENTS) & zmq.POLLIN)

    async def send(self, ident: bytes, frame: bytes) -> bool:
        """Send without waiting; False when the peer is gone or not reading."""
        try:
            await self.sock.send_multipart([ident, frame], flags=zmq.NOBLOCK)
            return True
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def send_batch(self, frames: list[tuple[bytes, bytes]]) -> list[bytes]:
        """Send each (peer, frame) without waiting; the peers that are gone or not
        reading (those sends failed).

        NOTE: through the plain view of the socket, then one ``get(EVENTS)`` on the
        asyncio socket, which re-arms its reader (a send may swallow the edge that
        would wake a pending recv). The asyncio send did that after every frame.
        """
        failed = []
        send = self._sync.send_multipart
        for ident, frame in frames:
            try:
                send([ident, frame], flags=zmq.NOBLOCK)
            except zmq.Again:
                failed.append(ident)
            except zmq.ZMQError as e:
                if e.errno != zmq.EHOSTUNREACH:
                    raise
                failed.append(ident)
        self.sock.get(zmq.EVENTS)
        return failed

    async def watch_disconnects(self, on_disconnect: Callable[[], object]) -> None:
        """Call ``on_disconnect`` (sync or async) after each peer disconnect."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                # NOTE: the peer's routing entry goes a moment after the event.
                await asyncio.sleep(0.05)
                result = on_disconnect()
                if asyncio.iscoroutine(result):
                    await result

    def close(self) -> None:
        self.sock.disable_monitor()
        self._monitor.close(linger=0)
        self.sock.close(linger=1000)


def open_ports(ctx: zmq.asyncio.Context, config: SchedulerConfig) -> tuple[RouterPort, RouterPort, AsyncioAuthenticator | None]:
    """The client port, the worker port and, with CURVE, the authenticator that
    admits only peers whose public certificate is in --curve-authorized-keys."""
    authenticator = None
    if config.curve:
        authenticator = AsyncioAuthenticator(ctx)
        authenticator.start()
        authenticator.configure_curve(domain="*", location=config.curve_authorized_keys)
    key = config.curve_secret_key
    # A client may pause reading for up to 30 s (a slow consumer, a GC pause) before
    # it counts as gone; a worker is taken for gone after 1.5 s of no ZMTP pong.
    clients = RouterPort(
        ctx, config.client_address, rcvhwm=1000, max_msg_size=4 * config.max_frame_bytes,
        curve_secret_key=key, heartbeat_timeout_ms=30_000,
    )
    workers = RouterPort(ctx, config.worker_address, curve_secret_key=key)
    return clients, workers, authenticator
