"""The engine client's connection to the scheduler's client port: one ZMQ DEALER (CURVE
when keys are given) and a monitor of its handshakes and disconnections, connected
within a deadline or not at all (`EngineUnreachable`)."""

from __future__ import annotations

import time

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from frontend.engine.outputs import EngineUnreachable
from protocol.curve import apply_client


class SchedulerSocket:
    __slots__ = ("sock", "monitor")

    def __init__(self, sock: zmq.asyncio.Socket, monitor: zmq.asyncio.Socket):
        self.sock, self.monitor = sock, monitor

    @classmethod
    async def connect(cls, ctx: zmq.asyncio.Context, address: str, curve_keys: tuple[str, str] | None,
                      timeout: float) -> SchedulerSocket:
        """A new socket connected to the scheduler; EngineUnreachable if not within ``timeout``."""
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        if curve_keys is not None:
            apply_client(sock, *curve_keys)
        conn = cls(sock, sock.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED))
        sock.connect(address)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not await conn.monitor.poll(left * 1000):
                conn.close()
                raise EngineUnreachable(f"cannot reach the scheduler at {address} within {timeout:g} s")
            if await conn.next_event() == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return conn

    async def next_event(self) -> int:
        return parse_monitor_message(await self.monitor.recv_multipart())["event"]

    def close(self) -> None:
        # NOTE: stop the monitor before the socket closes: otherwise its inproc
        # endpoint (named after the socket's fd, in the shared context) can outlive
        # it, and the next client whose socket gets that fd never hears its events.
        self.sock.disable_monitor()
        self.sock.close(linger=0)
        self.monitor.close(linger=0)
