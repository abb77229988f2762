"""A streamed chat answer (vLLM's ``chat_completion_stream_generator``): the heads (each
choice's role, then any echo), one ``chat.completion.chunk`` per delta, rendered in the
engine client's reader pass (`ChatStream.render`, which must not block), through the
tool parser when one is configured, and the usage chunk last."""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontend.engine.streaming import StreamedChoices, TextChunk
from frontend.http.metrics import ChoiceGroups
from frontend.openai.logprobs import chat_logprobs
from frontend.openai.serving import (
    ServingContext,
    choice_requests,
    final_stream_usage,
    now,
    send_event,
    serve_sse,
    stream_chunk,
    stream_usage,
)
from frontend.sampling.params import EngineParams
from frontend.schema.requests import ChatCompletionRequest
from frontend.tools.calls import StreamedToolCalls, logged_delta

_encode = msgspec.json.encode


def stream_choice(i, delta, lp=None, finish_reason=None, stop_reason=None, token_ids=None) -> dict:
    """One choice of a stream chunk. NOTE: as vLLM's (exclude_unset), stop_reason only on the chunk that finishes it."""
    if finish_reason is None:
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None, "token_ids": token_ids}
    return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "token_ids": token_ids}


class ChatStream:
    """One streamed chat answer: its chunks and, per choice, the tokens generated and
    cached, the text (for --enable-log-outputs), the last tokens (its logprobs' decoding
    context) and its tool parser."""

    __slots__ = ("ctx", "request_id", "ids", "params", "num_logprobs", "as_ids", "with_ids", "created", "include_usage",
                 "continuous", "generated", "cached", "texts", "groups", "recent", "text_chunk", "tools")

    def __init__(self, ctx: ServingContext, req: ChatCompletionRequest, request_id: str, ids: list[int], params: EngineParams,
                 num_logprobs: int | None, as_ids: bool):
        n = params.n
        self.ctx, self.request_id, self.ids, self.params = ctx, request_id, ids, params
        self.num_logprobs, self.as_ids, self.with_ids = num_logprobs, as_ids, bool(req.return_token_ids)
        self.created = now()
        self.include_usage, self.continuous = ctx.include_usage(req.stream_options)
        self.generated, self.cached = [0] * n, [0] * n
        self.texts = [""] * n if ctx.output_log is not None else None
        self.groups = ChoiceGroups(ctx.metrics, n, 1, params.generate["max_tokens"])
        self.recent: list[list[int]] = [[] for _ in range(n)]
        self.text_chunk = TextChunk(lambda c: self.chunk([c]), lambda i, text: stream_choice(i, {"content": text}))
        # NOTE: with a tool parser (as vLLM's), every choice's text goes through its own parser.
        strict = ctx.config.enforce_strict_tool_calling
        self.tools = [StreamedToolCalls(ctx.tool_parser, ctx.tokenizer, req, not strict) for _ in range(n)] if ctx.tool_parser else None

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return stream_chunk(self.ctx, "chat.completion.chunk", self.request_id, self.created, self.include_usage, choices, use)

    def usage_so_far(self) -> dict | None:
        """With continuous_usage_stats, every chunk's usage."""
        return stream_usage(len(self.ids), sum(self.generated), chat=True) if self.continuous else None

    def render(self, d) -> bytes | None:
        """One delta's chunk (None: nothing to send yet); called in the reader's pass."""
        i = d.index
        self.generated[i] += len(d.token_ids)
        self.cached[i] = max(self.cached[i], d.num_cached_tokens)
        if self.texts is not None:
            self.texts[i] += d.text
            if self.tools is None:  # NOTE: with a parser, what it made of the text is logged (tool_chunk)
                self.ctx.output_log.delta(self.request_id, d.text, d.token_ids, d.finish_reason)
        lp = None
        if self.num_logprobs is not None and d.logprobs:
            lp = chat_logprobs(self.ctx.tokenizer, d.token_ids, d.logprobs, self.num_logprobs, self.as_ids, self.recent[i])
            self.recent[i] = (self.recent[i] + d.token_ids)[-4:]
        if d.finish_reason is not None:
            self.groups.finished(i, d.finish_reason, len(self.ids), self.generated[i])
        if self.tools is not None:
            return self.tool_chunk(d, lp)
        with_ids, continuous = self.with_ids, self.continuous
        if lp is None and not d.text and d.finish_reason is None and not with_ids:
            return None  # NOTE: as vLLM, a token with no text yet is still sent when it has logprobs (or its ids)
        if d.finish_reason is None and lp is None and not continuous and not with_ids:
            return self.text_chunk(i, d.text)  # the common chunk: only new text
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        token_ids = d.token_ids if with_ids else None
        return _encode(self.chunk([stream_choice(i, delta, lp, d.finish_reason, d.stop_reason, token_ids)], self.usage_so_far()))

    def tool_chunk(self, d, lp) -> bytes | None:
        finished = d.finish_reason is not None
        parser = self.tools[d.index]
        delta = parser.delta(d.text, finished)
        if delta is None:
            if not finished and lp is None:
                return None
            delta = {}
        finish_reason = parser.finish_reason(d.finish_reason) if finished else None
        if self.texts is not None:
            self.ctx.output_log.delta(self.request_id, logged_delta(delta), d.token_ids, d.finish_reason)
        token_ids = d.token_ids if self.with_ids else None
        return _encode(self.chunk([stream_choice(d.index, delta, lp, finish_reason, d.stop_reason, token_ids)], self.usage_so_far()))

    async def send_heads(self, resp: web.StreamResponse, role: str, echo: str) -> None:
        """The chunks before any output: as vLLM, the first of every choice carries only the role
        (and names the prompt's ids, null unless return_token_ids); then, echoing, one chunk per choice."""
        for i in range(self.params.n):
            first = {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
            head = self.chunk([first], stream_usage(len(self.ids), 0, chat=True) if self.continuous else None)
            head["prompt_token_ids"], head["prompt_text"] = self.ids if self.with_ids else None, None
            await send_event(resp, head)
        if echo:
            for i in range(self.params.n):
                echoed = {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
                await send_event(resp, self.chunk([echoed], stream_usage(len(self.ids), 0, chat=True) if self.continuous else None))

    async def run(self, request: web.Request, role: str, echo: str) -> web.StreamResponse:
        return await serve_sse(request, lambda resp: self.send(request, resp, role, echo))

    async def send(self, request: web.Request, resp: web.StreamResponse, role: str, echo: str) -> None:
        ctx, ids = self.ctx, self.ids
        await self.send_heads(resp, role, echo)
        await StreamedChoices(ctx, request, resp, self.render).run(choice_requests(self.request_id, [ids], self.params))
        if self.include_usage:
            await send_event(resp, self.chunk([], final_stream_usage(len(ids), sum(self.generated), ctx.cached(self.cached[0]))))
        if self.texts is not None:
            ctx.output_log.stream_end(self.request_id, self.texts)
