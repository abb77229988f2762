"""The scheduler's link to its worker: who it is, whether it is alive, and the
result of the one step in flight.

The link knows nothing of requests; the engine decides what a lost worker means.
"""

from __future__ import annotations

import asyncio
import time

from protocol.codec import Codec
from protocol.worker_messages import Heartbeat, StepResult
from scheduler.engine.sockets import RouterPort

HEARTBEAT_INTERVAL_S = 0.5


class WorkerLost(Exception):
    pass


class WorkerLink:
    def __init__(self, port: RouterPort, codec: Codec, timeout_s: float):
        self.port = port
        self.codec = codec
        self.timeout_s = timeout_s
        self.worker_id: bytes | None = None
        self.ready = False
        self.last_heard = 0.0
        self.last_sent = 0.0
        self._result: asyncio.Future[StepResult] | None = None

    def is_ours(self, ident: bytes) -> bool:
        return ident == self.worker_id

    def attach(self, ident: bytes) -> None:
        self.worker_id = ident
        self.last_heard = time.monotonic()

    def detach(self) -> None:
        self.worker_id = None
        self.ready = False

    def heard_from(self, ident: bytes) -> None:
        if ident == self.worker_id:
            self.last_heard = time.monotonic()

    def silent(self) -> bool:
        return time.monotonic() - self.last_heard > self.timeout_s

    async def send(self, msg) -> int:
        """Send to the worker; WorkerLost when its connection is gone."""
        frame = self.codec.encode(msg)
        if self.worker_id is None or not await self.port.send(self.worker_id, frame):
            raise WorkerLost("the worker's connection is gone")
        self.last_sent = time.monotonic()
        return len(frame)

    async def heartbeat_if_idle(self) -> None:
        if time.monotonic() - self.last_sent > HEARTBEAT_INTERVAL_S:
            await self.send(Heartbeat(time.time()))

    # --- the step in flight -----------------------------------------------------------

    def expect_result(self) -> None:
        self._result = asyncio.get_running_loop().create_future()

    def step_in_flight(self) -> bool:
        return self._result is not None and not self._result.done()

    def deliver(self, ident: bytes, result: StepResult) -> None:
        if ident == self.worker_id and self.step_in_flight():
            self._result.set_result(result)

    def fail_step(self, error: Exception) -> bool:
        """Fail the step in flight; False when there is none."""
        if not self.step_in_flight():
            return False
        self._result.set_exception(error)
        return True

    async def await_result(self) -> StepResult:
        """The result of the step in flight; WorkerLost if the worker falls silent."""
        try:
            while True:
                try:
                    return await asyncio.wait_for(asyncio.shield(self._result), HEARTBEAT_INTERVAL_S)
                except TimeoutError:
                    if self.silent():
                        raise WorkerLost(f"no result for {self.timeout_s} s") from None
        finally:
            self._result = None
