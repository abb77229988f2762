"""The engine client's refusals over a real ZMQ socket (issue 23's hangs): a Generate
the wire cannot carry is refused before it is sent, naming the field; a refusal that
names a request fails that request with its field; a refusal naming no request fails
every request the scheduler has not answered yet (and aborts them), never one it has
answered. Every wait is bounded."""

from __future__ import annotations

import asyncio

import pytest
import zmq
import zmq.asyncio
from kvtest.engine_sinks import WAIT_S, RecordingSink, until

from frontend.engine.client import EngineClient
from frontend.engine.outputs import EngineError
from protocol.client_messages import (
    Abort,
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    RequestError,
    TokenOutput,
)
from protocol.codec import Codec


def run_with_router(test):
    """``test(client, router, codec_in, codec_out)`` against a ROUTER on a free port."""

    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = EngineClient(f"tcp://127.0.0.1:{port}")
        try:
            await client.connect(WAIT_S)
            await test(client, router, Codec(ClientRequest), Codec(ClientResponse))
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_a_refusal_naming_no_request_fails_the_unanswered_ones_only():
    async def test(client, router, codec_in, codec_out):
        answered, unanswered = RecordingSink(), RecordingSink()
        await client.start("answered", [1, 2], {"max_tokens": 4}, answered)
        await client.start("unanswered", [1, 2], {"max_tokens": 4}, unanswered)
        ident = None
        for _ in range(2):
            ident, frame = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
            assert isinstance(codec_in.decode(frame), Generate)
        await router.send_multipart([ident, codec_out.encode(EngineCoreOutputs([TokenOutput("answered", [7])]))])
        await until(lambda: answered.outputs)
        await router.send_multipart([ident, codec_out.encode(RequestError("malformed frame: truncated"))])
        await until(lambda: unanswered.errors)
        assert "could not read a request" in str(unanswered.errors[0]) and not answered.errors
        # the unanswered one is aborted at the scheduler too (it may have read it after all)
        _, frame = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert codec_in.decode(frame) == Abort(request_id="unanswered")
        await router.send_multipart([ident, codec_out.encode(EngineCoreOutputs([TokenOutput("answered", [8], True, "length")]))])
        await until(lambda: len(answered.outputs) == 2)
        assert client.num_in_flight == 0

    run_with_router(test)


def test_a_refusal_naming_a_request_fails_it_with_the_field():
    async def test(client, router, codec_in, codec_out):
        sink = RecordingSink()
        await client.start("r1", [1, 2], {"max_tokens": 4, "stop_token_ids": [2**40]}, sink)
        ident, frame = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        assert codec_in.decode(frame).stop_token_ids == [2**40]  # any int64 crosses the wire
        await router.send_multipart([ident, codec_out.encode(RequestError("out of vocab", "r1", "stop_token_ids"))])
        await until(lambda: sink.errors)
        assert (str(sink.errors[0]), sink.errors[0].param) == ("out of vocab", "stop_token_ids")
        assert client.num_in_flight == 0

    run_with_router(test)


@pytest.mark.parametrize(("request_id", "params", "field"), [
    ("x" * 257, {}, "request_id"),
    ("r", {"stop_token_ids": [2**70]}, None),  # not even msgpack: no field in the message
    ("r", {"allowed_token_ids": [-(2**64)]}, None),
    ("r", {"logit_bias": {3: 101.0}}, "logit_bias"),
])
def test_a_generate_the_wire_cannot_carry_is_refused_before_it_is_sent(request_id, params, field):
    async def test(client, router, codec_in, codec_out):
        with pytest.raises(EngineError) as info:
            await client.start(request_id, [1, 2], {"max_tokens": 4, **params}, RecordingSink())
        assert "cannot be sent to the engine" in str(info.value) and info.value.param == field
        assert client.num_in_flight == 0
        assert not await router.poll(300), "the frame was sent"

    run_with_router(test)
