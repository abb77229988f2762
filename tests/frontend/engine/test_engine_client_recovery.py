"""The engine client across a scheduler that dies and comes back (a ROUTER socket closed
and bound again on the same port, standing in for a restarted scheduler): requests in
flight are given to the new one with the tokens they already streamed, requests started
meanwhile wait and go too, an aborted one does not; nothing is sent before the scheduler
says it is ready; a scheduler that never comes back fails the held requests after the
bound, with the 503 wording. Real ZMQ sockets; every wait bounded."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio
from kvtest.engine_sinks import WAIT_S, RecordingSink, until

from frontend.engine.client import EngineClient
from frontend.openai.serving import engine_error
from protocol.client_messages import (
    ClientRequest,
    ClientResponse,
    EngineCoreOutputs,
    Generate,
    TokenOutput,
)
from protocol.codec import Codec


def _router(ctx, port: int | None = None):
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    if port is None:
        return sock, sock.bind_to_random_port("tcp://127.0.0.1")
    sock.bind(f"tcp://127.0.0.1:{port}")
    return sock, port


async def _recv(router, codec_in, n: int) -> tuple[bytes, dict[str, Generate]]:
    got, ident = {}, None
    for _ in range(n):
        ident, frame = await asyncio.wait_for(router.recv_multipart(), WAIT_S)
        msg = codec_in.decode(frame)
        got[msg.request_id] = msg
    return ident, got


def test_a_restarted_scheduler_gets_every_request_in_flight_with_its_outputs():
    async def main():
        ctx = zmq.asyncio.Context()
        codec_in, codec_out = Codec(ClientRequest), Codec(ClientResponse)
        router, port = _router(ctx)
        ready = {"now": True}

        async def scheduler_ready() -> bool:
            return ready["now"]

        client = EngineClient(f"tcp://127.0.0.1:{port}", restart_timeout_s=WAIT_S, scheduler_ready=scheduler_ready)
        sinks = {rid: RecordingSink() for rid in ("streamed", "silent", "aborted", "meanwhile")}
        try:
            await client.connect(WAIT_S)
            for rid in ("streamed", "silent", "aborted"):
                await client.start(rid, [1, 2, 3], {"max_tokens": 6, "prompt_logprobs": 1}, sinks[rid])
            ident, _ = await _recv(router, codec_in, 3)
            await router.send_multipart([ident, codec_out.encode(EngineCoreOutputs([TokenOutput("streamed", [7, 8])]))])
            await until(lambda: sinks["streamed"].outputs)

            # The scheduler dies; it is not ready at once when it comes back.
            router.close(linger=0)
            ready["now"] = False
            await until(lambda: client._recovery is not None)
            await client.start("meanwhile", [4], {"max_tokens": 2}, sinks["meanwhile"])
            client.abort(["aborted"])
            router, _ = _router(ctx, port)
            await asyncio.sleep(0.5)
            assert not await router.poll(0), "nothing may be sent before the scheduler is ready"
            ready["now"] = True
            ident, got = await _recv(router, codec_in, 3)

            assert set(got) == {"streamed", "silent", "meanwhile"}
            assert got["streamed"].prompt_token_ids == [1, 2, 3] and got["streamed"].resumed_token_ids == [7, 8]
            assert got["streamed"].max_tokens == 6 and got["streamed"].prompt_logprobs is None
            assert got["silent"].resumed_token_ids == [] and got["silent"].prompt_logprobs == 1
            assert got["meanwhile"].prompt_token_ids == [4]
            # The stream goes on from the new scheduler.
            await router.send_multipart([ident, codec_out.encode(EngineCoreOutputs([
                TokenOutput("streamed", [9, 10, 11, 12], finished=True, finish_reason="length")]))])
            await until(lambda: sinks["streamed"].outputs[-1].finished)
            assert sinks["streamed"].token_ids == [7, 8, 9, 10, 11, 12]
            assert not any(s.errors for s in sinks.values())
            assert await asyncio.wait_for(router.poll(200), WAIT_S) == 0  # no abort of the aborted one reached it
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())


def test_a_scheduler_that_never_comes_back_fails_the_held_requests_with_503():
    async def main():
        ctx = zmq.asyncio.Context()
        router, port = _router(ctx)
        client = EngineClient(f"tcp://127.0.0.1:{port}", restart_timeout_s=0.5)
        sink = RecordingSink()
        try:
            await client.connect(WAIT_S)
            await client.start("r", [1, 2], {"max_tokens": 4}, sink)
            await asyncio.wait_for(router.recv_multipart(), WAIT_S)
            router.close(linger=0)
            await until(lambda: sink.errors)
            (error,) = sink.errors
            assert "did not come back within 0.5 s" in str(error)
            assert engine_error(error).status == 503
            assert client.num_in_flight == 0
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())
