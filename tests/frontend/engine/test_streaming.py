"""Streamed responses fed in the engine client's reader pass (``frontend.engine.streaming``),
without a server: the pre-encoded chunk equals the chunk encoded whole; events reach
the connection framed as HTTP chunks, in order, each connection's frames of a step in
one write once the step's pass is over; a stop string, a failing render, a
closed connection and a cancelled handler each abort what is still running. And the
engine client itself over a real ZMQ socket: a sink that raises fails only its own
request (aborted at the scheduler), the others keep streaming."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import msgspec
import pytest
import zmq
import zmq.asyncio

from frontend.engine.client import EngineClient
from frontend.engine.outputs import EngineError
from frontend.engine.streaming import ClientGone, StreamedChoices, TextChunk, WriteBatch
from frontend.sampling.params import EngineParams
from frontend.text.tokenizer import Tokenizer
from protocol.client_messages import Abort, ClientRequest, EngineCoreOutputs, Generate, TokenOutput
from protocol.codec import Codec

TEXTS = ["", "plain", 'quote " and \\ backslash', "new\nline\ttab", "\x00\x1f control", "ünïcödé ✓ 漢字 🙂", "\u2028\u2029"]


def completion_chunk(choices, use=None):
    c = {"id": "cmpl-1", "object": "text_completion", "created": 17, "model": 'a "model"/ü', "choices": choices}
    if use is not None:
        c["usage"] = use
    return c


def completion_choice(i, text):
    return {"index": i, "text": text, "logprobs": None, "finish_reason": None, "stop_reason": None}


def chat_choice(i, text):
    return {"index": i, "delta": {"content": text}, "logprobs": None, "finish_reason": None, "stop_reason": None}


@pytest.mark.parametrize("choice", [completion_choice, chat_choice])
def test_a_text_chunk_is_the_chunk_encoded_whole(choice):
    tc = TextChunk(lambda c: completion_chunk([c]), choice)
    for index in (0, 7, 1234):
        for text in TEXTS:
            got = tc(index, text)
            assert got == msgspec.json.encode(completion_chunk([choice(index, text)]))
            assert json.loads(got)["choices"][0]["index"] == index


class FakeTransport:
    def __init__(self):
        self.data = bytearray()
        self.writes = 0
        self.closing = False

    def write(self, b: bytes) -> None:
        assert not self.closing
        self.data += b
        self.writes += 1

    def is_closing(self) -> bool:
        return self.closing


class FakeEngine:
    def __init__(self):
        self.sinks, self.aborted, self.started, self.stopped = {}, [], [], []

    async def start(self, rid, prompt, params, sink):
        self.started.append(rid)
        self.sinks[rid] = sink

    def abort(self, ids, stopped=False):
        self.aborted += list(ids)
        self.stopped += list(ids) if stopped else []

    def check_admission_prompts(self, prompt_lens, n):
        pass  # no queue limits here (tests/frontend/engine/test_admission.py)


def unchunk(data: bytes) -> list[dict]:
    """HTTP chunked frames -> the JSON of each SSE event, checking the framing."""
    events, i = [], 0
    while i < len(data):
        j = data.index(b"\r\n", i)
        size = int(data[i:j], 16)
        payload = data[j + 2 : j + 2 + size]
        assert data[j + 2 + size : j + 4 + size] == b"\r\n"
        assert payload.startswith(b"data: ") and payload.endswith(b"\n\n")
        events.append(json.loads(payload[6:-2]))
        i = j + 4 + size
    return events


@pytest.fixture(scope="module")
def tokenizer(tiny_checkpoint):
    return Tokenizer(str(tiny_checkpoint))


def params(stop=()):
    gen = {"stop_token_ids": [], "min_tokens": 0}
    return EngineParams(gen, list(stop), False, True, 1)


def streamed(tokenizer, render=None, chunked=True):
    engine, transport = FakeEngine(), FakeTransport()
    ctx = SimpleNamespace(engine=engine, tokenizer=tokenizer, writes=WriteBatch(), config=SimpleNamespace(sse_keep_alive_interval=0))
    resp = SimpleNamespace(headers={"Transfer-Encoding": "chunked"} if chunked else {})
    render = render or (lambda d: msgspec.json.encode({"index": d.index, "text": d.text, "finish": d.finish_reason}))
    return (lambda: StreamedChoices(ctx, SimpleNamespace(transport=transport), resp, render)), engine, transport


def run_with(make, requests, feed):
    """Run a stream; ``feed(engine)`` plays the reader (after every choice started)."""

    async def main():
        stream = make()  # NOTE: in the loop: it makes its future there
        task = asyncio.create_task(stream.run(requests))
        while len(stream.ctx.engine.started) < len(requests) and not task.done():
            await asyncio.sleep(0)
        feed(stream.ctx.engine)
        return await asyncio.wait_for(task, 10)

    return asyncio.run(main())


def test_events_are_framed_in_order_and_the_stream_ends_with_its_last_choice(tokenizer):
    make, engine, transport = streamed(tokenizer)
    ids = tokenizer.encode("hello world, again", add_special_tokens=False)

    def feed(engine):
        for k, t in enumerate(ids):
            for rid in ("r-0", "r-1"):
                last = k == len(ids) - 1
                engine.sinks[rid].on_output(TokenOutput(rid, [t], finished=last, finish_reason="length" if last else None))

    run_with(make, [("r-0", 0, [1], params()), ("r-1", 1, [1], params())], feed)
    events = unchunk(bytes(transport.data))
    for i in (0, 1):
        mine = [e for e in events if e["index"] == i]
        assert "".join(e["text"] for e in mine) == "hello world, again"
        assert [e["finish"] for e in mine][-1] == "length" and all(e["finish"] is None for e in mine[:-1])
    assert engine.aborted == []  # both finished at the engine


def test_a_steps_frames_reach_each_connection_in_one_write_after_the_pass(tokenizer):
    make, engine, transport = streamed(tokenizer)
    seen = {}

    def feed(engine):
        for k, t in enumerate((5, 6)):  # two steps, one pass each
            for rid in ("r-0", "r-1"):  # n = 2: both choices on one connection
                engine.sinks[rid].on_output(TokenOutput(rid, [40 + t], finished=k == 1, finish_reason="length" if k else None))
            seen.setdefault("after the passes", transport.writes)

    run_with(make, [("r-0", 0, [1], params()), ("r-1", 1, [1], params())], feed)
    assert seen["after the passes"] == 0  # nothing written inside the passes
    assert transport.writes == 1  # the loop ran once after both: one write, four frames
    events = unchunk(bytes(transport.data))
    assert [(e["index"], e["finish"]) for e in events] == [(0, None), (1, None), (0, "length"), (1, "length")]


def test_without_chunked_framing_events_are_sent_as_they_are(tokenizer):
    make, _, transport = streamed(tokenizer, chunked=False)
    run_with(make, [("r-0", 0, [1], params())], lambda e: e.sinks["r-0"].on_output(TokenOutput("r-0", [5], True, "length")))
    assert bytes(transport.data).startswith(b"data: {") and bytes(transport.data).endswith(b"}\n\n")


def test_a_stop_string_ends_the_choice_and_aborts_its_engine_request(tokenizer):
    make, engine, transport = streamed(tokenizer)
    ids = tokenizer.encode("one two three four", add_special_tokens=False)

    def feed(engine):
        for t in ids:
            engine.sinks["r-0"].on_output(TokenOutput("r-0", [t]))

    run_with(make, [("r-0", 0, [1], params(stop=["three"]))], feed)
    events = unchunk(bytes(transport.data))
    assert "".join(e["text"] for e in events) == "one two "
    assert events[-1]["finish"] == "stop"
    assert engine.aborted == ["r-0"] and engine.stopped == ["r-0"]  # a finished request in the scheduler's metrics


def test_a_render_that_raises_fails_the_stream_and_aborts_the_rest(tokenizer):
    def render(d):
        raise ValueError("boom")

    make, engine, _ = streamed(tokenizer, render)
    with pytest.raises(ValueError, match="boom"):
        run_with(make, [("r-0", 0, [1], params()), ("r-1", 1, [1], params())],
                 lambda e: e.sinks["r-0"].on_output(TokenOutput("r-0", [5])))
    assert sorted(engine.aborted) == ["r-0", "r-1"] and engine.stopped == []


def test_a_closed_connection_is_client_gone_and_aborts(tokenizer):
    make, engine, transport = streamed(tokenizer)
    transport.closing = True
    with pytest.raises(ClientGone):
        run_with(make, [("r-0", 0, [1], params())], lambda e: e.sinks["r-0"].on_output(TokenOutput("r-0", [5])))
    assert engine.aborted == ["r-0"] and engine.stopped == []


def test_an_engine_error_ends_the_stream_with_it(tokenizer):
    make, engine, _ = streamed(tokenizer)
    with pytest.raises(EngineError, match="refused"):
        run_with(make, [("r-0", 0, [1], params()), ("r-1", 1, [1], params())],
                 lambda e: e.sinks["r-1"].on_error(EngineError("refused")))
    assert engine.aborted == ["r-0"]  # r-1 ended at the engine already


def test_a_cancelled_handler_aborts_every_running_choice(tokenizer):
    make, engine, _ = streamed(tokenizer)

    async def main():
        task = asyncio.create_task(make().run([("r-0", 0, [1], params()), ("r-1", 1, [1], params())]))
        while len(engine.started) < 2:
            await asyncio.sleep(0)
        engine.sinks["r-0"].on_output(TokenOutput("r-0", [5], True, "length"))
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert engine.aborted == ["r-1"]


class _Raising:
    def __init__(self):
        self.errors = []

    def on_output(self, out):
        raise RuntimeError("a broken sink")

    def on_error(self, error):
        self.errors.append(error)


def test_a_sink_that_raises_fails_only_its_request_over_zmq():
    async def main():
        ctx = zmq.asyncio.Context()
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        port = router.bind_to_random_port("tcp://127.0.0.1")
        client = EngineClient(f"tcp://127.0.0.1:{port}")
        codec_in, codec_out = Codec(ClientRequest), Codec(EngineCoreOutputs)
        try:
            await client.connect(10)
            bad = _Raising()
            await client.start("bad", [1, 2], {"max_tokens": 4}, bad)
            good = client.generate("good", [1, 2], {"max_tokens": 4})
            first = asyncio.ensure_future(good.__anext__())
            got = []
            for _ in range(2):
                identity, frame = await asyncio.wait_for(router.recv_multipart(), 10)
                got.append(codec_in.decode(frame))
            assert {g.request_id for g in got} == {"bad", "good"} and all(isinstance(g, Generate) for g in got)
            step = EngineCoreOutputs([TokenOutput("bad", [7]), TokenOutput("good", [8])])
            await router.send_multipart([identity, codec_out.encode(step)])
            out = await asyncio.wait_for(first, 10)
            assert out.new_token_ids == [8]
            _, frame = await asyncio.wait_for(router.recv_multipart(), 10)
            assert codec_in.decode(frame) == Abort(request_id="bad")
            assert len(bad.errors) == 1 and "internal error" in str(bad.errors[0])
            await router.send_multipart([identity, codec_out.encode(EngineCoreOutputs([TokenOutput("good", [9], True, "length")]))])
            rest = [o async for o in good]
            assert [o.new_token_ids for o in rest] == [[9]]
            assert client.num_in_flight == 0
        finally:
            await client.close()
            router.close(linger=0)
            ctx.term()

    asyncio.run(main())
