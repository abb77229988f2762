"""A client socket's replies one at a time, for tests that read the client port raw.

The scheduler sends one `EngineCoreOutputs` frame per client per step; `Replies`
hands out its `TokenOutput`s one by one (an empty frame, a liveness probe, gives
none), and each `RequestError` as it comes. Every wait is bounded.
"""

from __future__ import annotations

import time
from collections import deque

import zmq

from protocol.client_messages import ClientResponse, EngineCoreOutputs, RequestError, TokenOutput
from protocol.codec import Codec

_codec: Codec = Codec(ClientResponse)


class NoReply(AssertionError):
    """Nothing arrived within the bound."""


class Replies:
    def __init__(self, sock: zmq.Socket):
        self.sock = sock
        self._pending: deque[TokenOutput] = deque()
        # The request ids of each EngineCoreOutputs frame read, in order.
        self.frames: list[list[str]] = []

    def recv(self, timeout_s: float) -> TokenOutput | RequestError:
        """The next TokenOutput or RequestError; NoReply after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(int(left * 1000), 1)):
                raise NoReply(f"no reply from the scheduler within {timeout_s:g} s")
            msg = _codec.decode(self.sock.recv())
            if not isinstance(msg, EngineCoreOutputs):
                return msg
            self.frames.append([o.request_id for o in msg.outputs])
            self._pending.extend(msg.outputs)
        return self._pending.popleft()

    def poll(self, timeout_s: float) -> TokenOutput | RequestError | None:
        """The next reply, or None when none comes within ``timeout_s``."""
        try:
            return self.recv(timeout_s)
        except NoReply:
            return None
