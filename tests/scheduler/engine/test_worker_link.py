"""The worker link's state machine, in-process over a stand-in port.

    DETACHED -> HANDSHAKING -> READY -> STEP_IN_FLIGHT -> READY ...; lose() -> DETACHED

Every transition settles the step in flight exactly once; on_lost is called once
per loss; results that do not belong to the step in flight are dropped.
"""

from __future__ import annotations

import asyncio

import pytest

from protocol.codec import Codec
from protocol.worker_messages import Heartbeat, StepResult, WorkerHello, WorkerToScheduler
from scheduler.engine.worker_link import LinkState, WorkerLink, WorkerLost

A, B = b"\x00A", b"\x00B"
HELLO = WorkerHello(0, 1, 64, 16, 512, 1)


class StandInPort:
    """RouterPort's surface the link uses: send (False once the peer is gone)."""

    def __init__(self):
        self.gone: set[bytes] = set()
        self.sent: list[tuple[bytes, bytes]] = []
        self.pending = False

    async def send(self, ident: bytes, frame: bytes) -> bool:
        if ident in self.gone:
            return False
        self.sent.append((ident, frame))
        return True

    def has_pending(self) -> bool:
        return self.pending


def make_link(timeout_s: float = 10.0):
    losses: list[tuple[str, LinkState, bool]] = []
    port = StandInPort()
    link = WorkerLink(port, Codec(WorkerToScheduler), timeout_s, lambda why, was, clean: losses.append((why, was, clean)))
    return link, port, losses


def ready_link(ident: bytes = A):
    link, port, losses = make_link()
    link.begin_handshake(ident, HELLO, 64)
    assert link.state is LinkState.HANDSHAKING and not link.ready
    assert link.acknowledge(ident)
    assert link.state is LinkState.READY and link.ready
    return link, port, losses


def test_a_step_result_settles_the_step_and_returns_to_ready():
    async def main():
        link, _, losses = ready_link()
        link.begin_step(7)
        assert link.state is LinkState.STEP_IN_FLIGHT
        assert link.deliver(A, StepResult(7, [1], [5]))
        result = await link.await_result()
        assert (result.step_id, result.sampled_token_ids) == (7, [5])
        assert link.state is LinkState.READY and losses == []

    asyncio.run(main())


def test_hello_mid_step_from_the_same_worker_settles_the_step_once_and_drops_its_late_result():
    async def main():
        link, _, losses = ready_link()
        link.begin_step(3)
        waiter = asyncio.ensure_future(link.await_result())
        await asyncio.sleep(0)
        # What the engine does on a hello from its own worker: lose it, then handshake again.
        assert link.lose("the worker said hello again")
        link.begin_handshake(A, HELLO, 64)
        with pytest.raises(WorkerLost, match="hello again"):
            await waiter
        assert losses == [("the worker said hello again", LinkState.STEP_IN_FLIGHT, False)]
        # Its late result of step 3: nothing is in flight, so it is dropped.
        assert not link.deliver(A, StepResult(3, [1], [5]))
        assert link.state is LinkState.HANDSHAKING
        assert link.acknowledge(A) and link.state is LinkState.READY
        assert len(losses) == 1

    asyncio.run(main())


def test_a_result_that_arrived_but_was_not_taken_before_a_loss_is_not_applied():
    async def main():
        link, _, losses = ready_link()
        link.begin_step(4)
        waiter = asyncio.ensure_future(link.await_result())  # the step loop, waiting
        await asyncio.sleep(0)
        # The result arrives; before the step loop runs again, the worker is lost and
        # a worker handshakes (all in the worker loop's turn).
        assert link.deliver(A, StepResult(4))
        link.lose("gone")
        link.begin_handshake(A, HELLO, 64)
        link.acknowledge(A)
        with pytest.raises(WorkerLost, match="before the result of step 4"):
            await waiter
        assert link.state is LinkState.READY and len(losses) == 1

    asyncio.run(main())


def test_results_of_another_step_or_another_worker_are_dropped():
    async def main():
        link, _, _ = ready_link()
        assert not link.deliver(A, StepResult(0))  # nothing in flight
        link.begin_step(9)
        assert not link.deliver(A, StepResult(8))  # another step
        assert not link.deliver(B, StepResult(9))  # another worker
        assert link.deliver(A, StepResult(9))
        assert not link.deliver(A, StepResult(9))  # a repeat
        assert (await link.await_result()).step_id == 9

    asyncio.run(main())


def test_a_late_result_after_loss_is_dropped_and_loss_is_reported_once():
    async def main():
        link, _, losses = ready_link()
        link.begin_step(1)
        assert link.lose("silent")
        assert not link.lose("silent again")
        assert not link.deliver(A, StepResult(1, [1], [2]))
        assert link.state is LinkState.DETACHED and link.worker_id is None
        assert losses == [("silent", LinkState.STEP_IN_FLIGHT, False)]

    asyncio.run(main())


def test_a_loss_during_the_handshake_is_reported_as_such_and_nothing_is_acknowledged():
    link, _, losses = make_link()
    link.begin_handshake(A, HELLO, 64)
    link.lose("the worker refused WorkerReady: too small")
    assert losses == [("the worker refused WorkerReady: too small", LinkState.HANDSHAKING, False)]
    assert not link.acknowledge(A)
    assert link.state is LinkState.DETACHED and link.hello is None


def test_a_failed_send_loses_the_worker_and_settles_the_step():
    async def main():
        link, port, losses = ready_link()
        link.begin_step(2)
        port.gone.add(A)
        with pytest.raises(WorkerLost):
            await link.send(Heartbeat())
        with pytest.raises(WorkerLost):
            await link.await_result()  # the step went with the worker
        assert [w for _, w, _ in losses] == [LinkState.STEP_IN_FLIGHT]

    asyncio.run(main())


def test_silence_loses_the_worker_unless_frames_are_still_queued():
    link, port, losses = make_link(timeout_s=5.0)
    link.begin_handshake(A, HELLO, 64)
    link.acknowledge(A)
    link.last_heard -= 6.0
    port.pending = True  # the loop is behind, not the worker
    link.check_silence()
    assert link.ready and losses == []
    port.pending = False
    link.check_silence()
    assert not link.ready and losses[0][1] is LinkState.READY and "silent" in losses[0][0]


def test_a_clean_exit_is_reported_clean():
    link, _, losses = ready_link()
    link.lose("the worker is stopping (SIGTERM)", clean=True)
    assert losses == [("the worker is stopping (SIGTERM)", LinkState.READY, True)]


def test_transitions_out_of_order_are_refused():
    async def main():
        link, _, _ = make_link()
        with pytest.raises(RuntimeError):
            link.begin_step(0)  # detached
        link.begin_handshake(A, HELLO, 64)
        with pytest.raises(RuntimeError):
            link.begin_handshake(B, HELLO, 64)
        with pytest.raises(RuntimeError):
            link.begin_step(0)  # not yet acknowledged
        assert not link.acknowledge(B)

    asyncio.run(main())
