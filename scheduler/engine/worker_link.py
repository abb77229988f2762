"""The scheduler's link to its worker: one explicit state machine.

    DETACHED --hello--> HANDSHAKING --ack--> READY --begin_step--> STEP_IN_FLIGHT
        ^                    |                 ^                         |
        |                    |                 +---- result applied -----+
        +---- lose(why) -----+-----------------+-------------------------+

* HANDSHAKING: WorkerReady is sent; the worker's first message after it (a
  Heartbeat) acknowledges it. A WorkerError instead, silence or a send failure
  loses it. The engine builds nothing for a worker that has not acknowledged.
* STEP_IN_FLIGHT: one plan was sent; its result future is settled exactly once:
  by the result of *that* step from *that* worker, or by ``lose``. A result that
  arrives for another step, from another worker, or with nothing in flight is
  dropped (a late result of a lost worker never reaches the scheduler).
* ``lose`` is the only way out of a live state; it settles the step in flight and
  calls the engine's ``on_lost`` once, which decides what the requests become.

The link knows nothing of requests.
"""

from __future__ import annotations

import asyncio
import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from protocol.codec import Codec
from protocol.worker_messages import Heartbeat, StepResult, WorkerHello
from scheduler.engine.sockets import RouterPort, peer_name

log = logging.getLogger("scheduler")

HEARTBEAT_INTERVAL_S = 0.5


class WorkerLost(Exception):
    pass


class LinkState(enum.Enum):
    DETACHED = "detached"
    HANDSHAKING = "handshaking"
    READY = "ready"
    STEP_IN_FLIGHT = "step in flight"


@dataclass(slots=True)
class _Step:
    step_id: int
    result: asyncio.Future[StepResult]


class WorkerLink:
    def __init__(
        self, port: RouterPort, codec: Codec, timeout_s: float, on_lost: Callable[[str, LinkState, bool], None]
    ):
        self.port = port
        self.codec = codec
        self.timeout_s = timeout_s
        # on_lost(why, state it was in, clean): called once per loss, by ``lose``.
        self.on_lost = on_lost
        self.state = LinkState.DETACHED
        self.worker_id: bytes | None = None
        self.hello: WorkerHello | None = None  # of the worker handshaking or ready
        self.num_blocks = 0  # the pool size its WorkerReady carried
        self.last_heard = 0.0
        self.last_sent = 0.0
        self._step: _Step | None = None

    @property
    def ready(self) -> bool:
        return self.state in (LinkState.READY, LinkState.STEP_IN_FLIGHT)

    @property
    def name(self) -> str:
        return peer_name(self.worker_id)

    def is_ours(self, ident: bytes) -> bool:
        return self.worker_id is not None and ident == self.worker_id

    # --- transitions ------------------------------------------------------------------

    def begin_handshake(self, ident: bytes, hello: WorkerHello, num_blocks: int) -> None:
        """DETACHED -> HANDSHAKING (WorkerReady is about to be sent)."""
        if self.state is not LinkState.DETACHED:
            raise RuntimeError(f"handshake with worker {peer_name(ident)} while {self.state.value}")
        self.state = LinkState.HANDSHAKING
        self.worker_id, self.hello, self.num_blocks = ident, hello, num_blocks
        self.last_heard = time.monotonic()

    def acknowledge(self, ident: bytes) -> bool:
        """HANDSHAKING -> READY on the worker's first message after WorkerReady."""
        if self.state is LinkState.HANDSHAKING and self.is_ours(ident):
            self.state = LinkState.READY
            return True
        return False

    def begin_step(self, step_id: int) -> None:
        """READY -> STEP_IN_FLIGHT."""
        if self.state is not LinkState.READY:
            raise RuntimeError(f"step {step_id} begun while the worker link is {self.state.value}")
        result = asyncio.get_running_loop().create_future()
        # NOTE: a step lost before await_result took it has nobody to read its error.
        result.add_done_callback(_retrieve)
        self._step = _Step(step_id, result)
        self.state = LinkState.STEP_IN_FLIGHT

    def deliver(self, ident: bytes, result: StepResult) -> bool:
        """Settle the step in flight with its result; False (dropped) otherwise."""
        step = self._step
        if not self.is_ours(ident) or step is None or step.result.done() or result.step_id != step.step_id:
            expected = None if step is None else step.step_id
            log.warning("dropped a result for step %d from worker %s (in flight: step %s of worker %s)",
                        result.step_id, peer_name(ident), expected, self.name)
            return False
        step.result.set_result(result)
        return True

    def lose(self, why: str, clean: bool = False) -> bool:
        """Any live state -> DETACHED; settles the step in flight and calls on_lost.
        False when already detached (the loss was handled before)."""
        was = self.state
        if was is LinkState.DETACHED:
            return False
        step, self._step = self._step, None
        if step is not None and not step.result.done():
            step.result.set_exception(WorkerLost(why))
        self.state = LinkState.DETACHED
        try:
            self.on_lost(why, was, clean)
        finally:
            self.worker_id, self.hello, self.num_blocks = None, None, 0
        return True

    # --- liveness ---------------------------------------------------------------------

    def heard_from(self, ident: bytes) -> None:
        if self.is_ours(ident):
            self.last_heard = time.monotonic()

    def silent(self) -> bool:
        """Nothing from the worker for timeout_s. NOTE: frames still queued on the
        worker port mean the event loop is behind, not that the worker is silent."""
        return time.monotonic() - self.last_heard > self.timeout_s and not self.port.has_pending()

    def check_silence(self) -> None:
        if self.state is not LinkState.DETACHED and self.silent():
            self.lose(f"silent for more than {self.timeout_s} s ({self.state.value})")

    async def send(self, msg) -> int:
        """Send to the worker; on failure the worker is lost and WorkerLost raised."""
        frame = self.codec.encode(msg)
        if self.worker_id is None:
            raise WorkerLost("no worker")
        if not await self.port.send(self.worker_id, frame):
            why = "the worker's connection is gone"
            self.lose(why)
            raise WorkerLost(why)
        self.last_sent = time.monotonic()
        return len(frame)

    async def heartbeat_if_idle(self) -> None:
        if time.monotonic() - self.last_sent > HEARTBEAT_INTERVAL_S:
            await self.send(Heartbeat(time.time()))

    async def await_result(self) -> StepResult:
        """The result of the step in flight (STEP_IN_FLIGHT -> READY), or WorkerLost:
        the worker fell silent or was lost, also after its result arrived but before
        it was taken here (then the engine has already abandoned the step)."""
        step = self._step
        if step is None:
            raise WorkerLost("no step in flight")
        while True:
            try:
                result = await asyncio.wait_for(asyncio.shield(step.result), HEARTBEAT_INTERVAL_S)
                break
            except TimeoutError:
                self.check_silence()
        if self._step is not step:
            raise WorkerLost(f"the worker was lost before the result of step {step.step_id} was applied")
        self._step = None
        self.state = LinkState.READY
        return result


def _retrieve(future: asyncio.Future) -> None:
    if not future.cancelled():
        future.exception()
