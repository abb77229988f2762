"""A streamed response's choices, fed in the engine client's reader pass.

Every output of a step reaches its choice's sink inside the reader task's one pass
over the step (``EngineClient.start``): the choice's detokenizer runs
(``ChoiceState``), the endpoint's ``render`` turns the delta into the JSON of one SSE
event, framed as one HTTP chunk. The frames wait in `WriteBatch` until the pass is over,
then each connection gets its frames of the step in one write (n > 1 choices share
one). No task wakes and no coroutine runs per token; the handler's task only waits for
the last choice, then writes the tail (usage, ``[DONE]``) through aiohttp, after the
batch (both are loop callbacks, the batch's scheduled first).

The whole step is rendered before any of it is written, not each frame written as it
is rendered: a write likely wakes its HTTP client, which would then compete with the
rest of the pass for the cores (``bench frontend`` compares the two).

Most chunks carry only new text: `TextChunk` encodes the JSON around index and text
once per response, so such a chunk costs the text's encoding and one join.

With ``--sse-keep-alive-interval N``, a stream that wrote nothing for N seconds while
its choices run (queued, in prefill, between tokens) gets vLLM's SSE comment
``: keep-alive`` (which SSE clients ignore), as vLLM's ``with_sse_keep_alive``.

NOTE: these writes skip aiohttp's drain: a client that stops reading leaves its
response in the transport's buffer, at most its max_tokens' chunks (vLLM holds it in
the request's output queue instead). A closed connection ends the stream and aborts
its engine requests; aiohttp also cancels the handler then.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import msgspec
from aiohttp import web

from frontend.engine.generation import ChoiceDelta, ChoiceState
from frontend.engine.outputs import EngineError
from frontend.sampling.params import EngineParams

_encode = msgspec.json.encode
_INDEX, _TEXT = "\x00index\x00", "\x00text\x00"
KEEP_ALIVE = b": keep-alive\n\n"  # vLLM's SSE_KEEP_ALIVE_COMMENT


class ClientGone(ConnectionResetError):
    """The client closed the connection mid-stream: nothing more can be sent."""


class TextChunk:
    """The JSON of a chunk whose one choice carries only an index and new text.
    ``chunk(choice)`` builds the whole chunk dict from the choice dict; the choice is
    built once here with markers where the index and the text go."""

    __slots__ = ("_parts",)

    def __init__(self, chunk: Callable[[dict], dict], choice: Callable[[object, object], dict]):
        data = _encode(chunk(choice(_INDEX, _TEXT)))
        head, rest = data.split(_encode(_INDEX), 1)
        middle, tail = rest.split(_encode(_TEXT), 1)
        self._parts = (head, middle, tail)

    def __call__(self, index: int, text: str) -> bytes:
        head, middle, tail = self._parts
        return b"%b%d%b%b%b" % (head, index, middle, _encode(text), tail)


class WriteBatch:
    """Frames written during one pass of the reader, per transport, each transport's
    joined into one write by one loop callback once the pass is over."""

    __slots__ = ("_pending", "_scheduled")

    def __init__(self):
        self._pending: dict[asyncio.Transport, list[bytes]] = {}
        self._scheduled = False

    def add(self, transport: asyncio.Transport, frame: bytes) -> None:
        frames = self._pending.get(transport)
        if frames is None:
            self._pending[transport] = [frame]
        else:
            frames.append(frame)
        if not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        pending, self._pending, self._scheduled = self._pending, {}, False
        for transport, frames in pending.items():
            if not transport.is_closing():  # NOTE: a client gone meanwhile: its handler is being cancelled
                transport.write(frames[0] if len(frames) == 1 else b"".join(frames))


class _Sink:
    __slots__ = ("stream", "request_id", "state")

    def __init__(self, stream: StreamedChoices, request_id: str, state: ChoiceState):
        self.stream, self.request_id, self.state = stream, request_id, state

    def on_output(self, out) -> None:
        self.stream._on_output(self, out)

    def on_error(self, error: EngineError) -> None:
        self.stream._on_error(self, error)


class StreamedChoices:
    """The choices of one streaming response. ``render(delta)``: the JSON of the SSE
    event for a delta, or None to send nothing; called in the reader's pass, so it
    must not block. `run` starts the choices and returns once every one finished."""

    def __init__(self, ctx, request: web.Request, resp: web.StreamResponse, render: Callable[[ChoiceDelta], bytes | None]):
        self.ctx, self.render = ctx, render
        self.writes: WriteBatch = ctx.writes
        self.transport = request.transport
        # NOTE: aiohttp chose the framing when it prepared the headers (chunked on HTTP/1.1)
        self.chunked = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.open: dict[str, _Sink] = {}  # engine request id -> its unfinished choice
        self.keep_alive_s = float(ctx.config.sse_keep_alive_interval)
        self.last_write = 0.0  # loop time of the last event, for the keep-alive comments
        self._keep_alive: asyncio.TimerHandle | None = None

    async def run(self, requests: list[tuple[str, int, list[int], EngineParams]]) -> None:
        """Raises what ended the stream early (EngineError, APIError, ClientGone);
        every choice not finished by then is aborted, also when the handler is
        cancelled."""
        engine = self.ctx.engine
        if requests and requests[0][3].refusal is not None:
            raise requests[0][3].refusal
        if requests:  # vLLM's add_request check; after the preflight, a refusal ends the stream
            n = requests[0][3].n
            engine.check_admission_prompts([len(r[2]) for r in requests[::n]], n)
        if 0 < self.keep_alive_s < float("inf"):
            loop = asyncio.get_running_loop()
            self.last_write = loop.time()
            self._keep_alive = loop.call_later(self.keep_alive_s, self._tick)
        try:
            for rid, index, prompt, params in requests:
                if self.done.done():
                    break
                sink = self.open[rid] = _Sink(self, rid, ChoiceState(self.ctx.tokenizer, index, params, prompt))
                try:
                    await engine.start(rid, prompt, params.generate, sink)
                except BaseException:
                    self.open.pop(rid, None)
                    raise
            await self.done
        finally:
            if self._keep_alive is not None:
                self._keep_alive.cancel()
            if self.open:
                engine.abort(list(self.open))
                self.open.clear()
            if self.done.done() and not self.done.cancelled():
                self.done.exception()  # NOTE: retrieved, so asyncio never warns of it
            else:
                self.done.cancel()

    def write(self, data: bytes) -> None:
        """One SSE event, ``data`` its JSON, to the connection once the pass is over."""
        t = self.transport
        if t is None or t.is_closing():
            raise ClientGone("the client closed the connection")
        self.writes.add(t, b"%x\r\ndata: %b\n\n\r\n" % (len(data) + 8, data) if self.chunked else b"data: %b\n\n" % data)
        if self._keep_alive is not None:
            self.last_write = asyncio.get_running_loop().time()

    def _tick(self) -> None:
        """The keep-alive timer: a comment if nothing was written for the interval, then re-armed."""
        loop = asyncio.get_running_loop()
        idle = loop.time() - self.last_write
        if idle >= self.keep_alive_s:
            t = self.transport
            if t is None or t.is_closing():
                return
            self.writes.add(t, b"%x\r\n%b\r\n" % (len(KEEP_ALIVE), KEEP_ALIVE) if self.chunked else KEEP_ALIVE)
            self.last_write, idle = loop.time(), 0.0
        self._keep_alive = loop.call_later(self.keep_alive_s - idle, self._tick)

    def _fail(self, error: BaseException) -> None:
        if not self.done.done():
            self.done.set_exception(error)

    def _on_output(self, sink: _Sink, out) -> None:
        if self.done.done():
            return
        state = sink.state
        try:
            data = self.render(state.feed(out))
            if data is not None:
                self.write(data)
        except Exception as e:  # noqa: BLE001 - handed to the handler
            self._fail(e)
            return
        if state.finished:
            del self.open[sink.request_id]
            if not out.finished:
                self.ctx.engine.abort([sink.request_id], stopped=True)  # a stop string ended it first
            if not self.open:
                self.done.set_result(None)

    def _on_error(self, sink: _Sink, error: EngineError) -> None:
        self.open.pop(sink.request_id, None)
        self._fail(error)
