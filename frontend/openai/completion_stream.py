"""A streamed completion (vLLM's ``completion_stream_generator``): one ``text_completion``
chunk per delta, rendered in the engine client's reader pass (`CompletionStream.render`,
which must not block); under ``echo`` each choice's first chunk carries its prompt (and
its logprobs), with ``return_token_ids`` its prompt's ids; the usage chunk last."""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontend.engine.streaming import StreamedChoices, TextChunk
from frontend.http.metrics import ChoiceGroups
from frontend.openai.logprobs import completion_logprobs
from frontend.openai.prompt_logprobs import echoed_completion_logprobs
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
from frontend.schema.requests import CompletionRequest

_encode = msgspec.json.encode


def stream_choice(i, text, lp=None, finish_reason=None, stop_reason=None, prompt_ids=None, token_ids=None) -> dict:
    return {"index": i, "text": text, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "prompt_token_ids": prompt_ids, "token_ids": token_ids}


class CompletionStream:
    """One streamed completion: its chunks and, per choice (prompt-major, ``n`` per
    prompt), the tokens generated and cached, the logprobs' text offset and decoding
    context, whether its echo and its prompt's ids were sent."""

    __slots__ = ("ctx", "req", "request_id", "prompts", "params", "echo", "as_ids", "n", "created", "include_usage",
                 "continuous", "num_prompt", "generated", "cached", "groups", "offsets", "recent", "first", "with_ids",
                 "ids_sent", "echo_only", "text_chunk")

    def __init__(self, ctx: ServingContext, req: CompletionRequest, request_id: str, prompts: list[list[int]],
                 params: EngineParams, echo: list[str], as_ids: bool):
        n = self.n = params.n
        num_choices = len(prompts) * n
        self.ctx, self.req, self.request_id, self.prompts, self.params = ctx, req, request_id, prompts, params
        self.echo, self.as_ids = echo, as_ids
        self.created = now()
        self.include_usage, self.continuous = ctx.include_usage(req.stream_options)
        self.num_prompt = sum(len(p) for p in prompts)
        self.generated, self.cached, self.offsets = [0] * num_choices, [0] * num_choices, [0] * num_choices
        self.groups = ChoiceGroups(ctx.metrics, n, len(prompts), params.generate["max_tokens"])
        self.recent: list[list[int]] = [[] for _ in range(num_choices)]  # each choice's last output tokens
        self.first = [bool(req.echo)] * num_choices  # its echo still to send
        # return_token_ids: each choice's first chunk carries its prompt's ids, every chunk its new ones
        self.with_ids = bool(req.return_token_ids)
        self.ids_sent = [False] * num_choices
        self.echo_only = req.echo and req.max_tokens == 0
        self.text_chunk = TextChunk(lambda c: self.chunk([c]), stream_choice)

    def chunk(self, choices: list[dict], use: dict | None = None) -> dict:
        return stream_chunk(self.ctx, "text_completion", self.request_id, self.created, self.include_usage, choices, use)

    def logprobs(self, d, i: int, text: str) -> tuple[str, dict | None]:
        """The delta's text and logprobs; the first under echo carries the prompt's."""
        req, n = self.req, self.n
        if self.first[i]:
            # vLLM's first chunk under echo: the prompt (and its logprobs), then the first token's unless echo_only
            text, self.first[i] = self.echo[i // n] + ("" if self.echo_only else text), False
            if req.logprobs is None:
                return text, None
            return text, echoed_completion_logprobs(self.ctx.tokenizer, req, self.prompts[i // n], d.prompt_logprobs, d.token_ids,
                                                    d.logprobs or [], self.as_ids, self.echo_only)
        if req.logprobs is not None and d.logprobs:
            return text, completion_logprobs(self.ctx.tokenizer, d.token_ids, d.logprobs, req.logprobs, self.as_ids,
                                             self.offsets[i], self.recent[i])
        return text, None

    def render(self, d) -> bytes | None:
        """One delta's chunk (None: nothing to send yet); called in the reader's pass."""
        i = d.index
        self.generated[i] += len(d.token_ids)
        self.cached[i] = max(self.cached[i], d.num_cached_tokens)
        text, lp = self.logprobs(d, i, d.text)
        with_ids, continuous = self.with_ids, self.continuous
        if lp is not None and lp["tokens"]:
            self.offsets[i] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            self.recent[i] = (self.recent[i] + d.token_ids)[-4:]
        elif not text and d.finish_reason is None and not with_ids:
            return None  # NOTE: as vLLM, a token with no text yet is still sent when it has logprobs (or its ids)
        if d.finish_reason is not None:
            self.groups.finished(i, d.finish_reason, len(self.prompts[i // self.n]), self.generated[i])
        elif lp is None and not continuous and not with_ids:
            return self.text_chunk(i, text)  # the common chunk: only new text
        use = stream_usage(self.num_prompt, sum(self.generated), chat=False) if continuous else None
        prompt_ids = token_ids = None
        if with_ids:
            token_ids = d.token_ids
            if not self.ids_sent[i]:
                prompt_ids, self.ids_sent[i] = self.prompts[i // self.n], True
        return _encode(self.chunk([stream_choice(i, text, lp, d.finish_reason, d.stop_reason, prompt_ids, token_ids)], use))

    async def run(self, request: web.Request) -> web.StreamResponse:
        return await serve_sse(request, lambda resp: self.send(request, resp))

    async def send(self, request: web.Request, resp: web.StreamResponse) -> None:
        ctx = self.ctx
        await StreamedChoices(ctx, request, resp, self.render).run(choice_requests(self.request_id, self.prompts, self.params))
        if self.include_usage:
            cached = ctx.cached(sum(self.cached[::self.n]))
            await send_event(resp, self.chunk([], final_stream_usage(self.num_prompt, sum(self.generated), cached)))
