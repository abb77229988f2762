"""A fake scheduler for tests of ``python -m worker`` as a real process: the ROUTER
end of the worker's socket, driven by the test. Every receive is bounded."""

from __future__ import annotations

import time

import zmq

from kvtest.ports import free_port  # noqa: F401 (re-exported for the tests that import it from here)
from protocol.codec import Codec
from protocol.worker_messages import Heartbeat, WorkerToScheduler

STARTUP_S = 60.0  # importing torch on a loaded 2-core machine can be slow


class FakeScheduler:
    def __init__(self):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.codec: Codec = Codec(WorkerToScheduler)
        self.identity: bytes | None = None

    def recv(self, timeout_s: float, skip_heartbeats: bool = True):
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            if not self.sock.poll(int(left * 1000) + 1):
                break
            ident, frame = self.sock.recv_multipart()
            self.identity = ident
            msg = self.codec.decode(frame)
            if skip_heartbeats and isinstance(msg, Heartbeat):
                continue
            return msg
        raise AssertionError(f"nothing from the worker within {timeout_s} s")

    def send(self, msg) -> None:
        self.sock.send_multipart([self.identity, self.codec.encode(msg)])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
