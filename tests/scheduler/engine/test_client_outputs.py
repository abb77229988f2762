"""One EngineCoreOutputs frame per client per step, built from StepTokens columns;
sent once per client over a real ROUTER, the failed clients reported."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from protocol.client_messages import ClientResponse, EngineCoreOutputs, TokenLogprobs, TokenOutput
from protocol.codec import Codec
from protocol.worker_messages import SampledLogprobs
from scheduler.engine.client_outputs import final_outputs_by_client, outputs_by_client, send_outputs
from scheduler.engine.sockets import RouterPort
from scheduler.sched.outputs import StepTokens
from scheduler.sched.request import Request


def _request(rid: str, seq_id: int, client: bytes, cached: int) -> Request:
    r = Request(rid, [3, 4, 5], 4, seq_id=seq_id, client_id=client)
    r.num_cached_tokens = cached
    return r


A, B = b"client-a", b"client-b"
REQS = [_request("a0", 10, A, 16), _request("b0", 11, B, 0), _request("a1", 12, A, 4), _request("b1", 13, B, 8)]


def test_one_batch_per_client_in_batch_order_with_finishes_and_logprobs():
    step = StepTokens(1.0, REQS, [7, 8, 9, 6], [None] * 4, {1: "stop", 2: "length"})
    lp = [SampledLogprobs(12, -0.5, [9, 3], [-0.5, -1.5])]
    batches = outputs_by_client(step, lp)
    assert list(batches) == [A, B]
    assert batches[A] == EngineCoreOutputs([
        TokenOutput("a0", [7], num_cached_tokens=16),
        TokenOutput("a1", [9], True, "length", 4, [TokenLogprobs(-0.5, [9, 3], [-0.5, -1.5])]),
    ])
    assert batches[B] == EngineCoreOutputs([TokenOutput("b0", [8], True, "stop"), TokenOutput("b1", [6], num_cached_tokens=8)])


def test_no_logprobs_unless_a_row_has_them_and_an_empty_step_sends_nothing():
    step = StepTokens(1.0, REQS[:1], [7], [None])
    assert outputs_by_client(step, []) == {A: EngineCoreOutputs([TokenOutput("a0", [7], num_cached_tokens=16)])}
    assert outputs_by_client(StepTokens(1.0, [], [], [])) == {}


def test_final_outputs_group_by_client_and_a_never_admitted_request_reports_zero_cached():
    waiting = Request("w", [3], 4, seq_id=20, client_id=B)  # num_cached_tokens is -1: never admitted
    batches = final_outputs_by_client([REQS[0], waiting, REQS[2]], "abort")
    assert batches == {
        A: EngineCoreOutputs([TokenOutput("a0", [], True, "abort", 16), TokenOutput("a1", [], True, "abort", 4)]),
        B: EngineCoreOutputs([TokenOutput("w", [], True, "abort", 0)]),
    }


def test_send_outputs_one_frame_per_client_and_reports_a_gone_one():
    async def go():
        ctx = zmq.asyncio.Context()
        port = RouterPort(ctx, "tcp://127.0.0.1:*")
        address = port.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, A)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(address)
            # The ROUTER knows the dealer once it has heard from it.
            await dealer.send(b"hello")
            assert await asyncio.wait_for(port.recv(), 10)
            step = StepTokens(1.0, REQS, [7, 8, 9, 6], [None] * 4)
            codec = Codec(ClientResponse)
            failed = send_outputs(port, codec, outputs_by_client(step))
            frames = [await asyncio.wait_for(dealer.recv(), 10)]
            assert await dealer.poll(200) == 0  # nothing more: one frame for both of A's
            return failed, [codec.decode(f) for f in frames]
        finally:
            dealer.close(linger=0)
            port.close()
            ctx.term()

    failed, msgs = asyncio.run(go())
    assert failed == [B]  # never connected: unroutable
    assert msgs == [EngineCoreOutputs([TokenOutput("a0", [7], num_cached_tokens=16), TokenOutput("a1", [9], num_cached_tokens=4)])]


def test_a_recv_pending_during_send_batch_still_wakes():
    """send_batch goes through the plain view of the socket; the asyncio recv waiting
    on the same socket must still hear the next message (its reader is re-armed)."""

    async def go():
        ctx = zmq.asyncio.Context()
        port = RouterPort(ctx, "tcp://127.0.0.1:*")
        address = port.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.IDENTITY, A)
        dealer.setsockopt(zmq.LINGER, 0)
        try:
            dealer.connect(address)
            await dealer.send(b"hello")
            await asyncio.wait_for(port.recv(), 10)
            pending = asyncio.ensure_future(port.recv())
            await asyncio.sleep(0.05)  # the recv is waiting on the socket
            replies = []
            for k in range(20):
                assert port.send_batch([(A, b"out-%d" % k)]) == []
                await dealer.send(b"in-%d" % k)
                frames, _ = await asyncio.wait_for(pending, 10)
                replies.append(frames[1].bytes)
                pending = asyncio.ensure_future(port.recv())
            pending.cancel()
            got = [await asyncio.wait_for(dealer.recv(), 10) for _ in range(20)]
            return replies, got
        finally:
            dealer.close(linger=0)
            port.close()
            ctx.term()

    replies, got = asyncio.run(go())
    assert replies == [b"in-%d" % k for k in range(20)]
    assert got == [b"out-%d" % k for k in range(20)]
