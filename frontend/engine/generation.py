"""One HTTP request's engine requests: a choice is one engine request, detokenized
as it streams (`ChoiceState`, fed one output at a time, no awaiting), stopped early on
a stop string (aborting the engine request, so its blocks are freed at once).
``n > 1`` or several prompts are several choices, merged into one stream in the order
their outputs arrive (`run_choice` and `merge`, for responses that are not streamed;
streamed ones are fed in the engine client's reader pass, ``frontend.engine.streaming``).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from frontend.engine.client import EngineClient
from frontend.sampling.params import EngineParams
from frontend.text.detokenizer import IncrementalDetokenizer
from frontend.text.tokenizer import Tokenizer
from protocol.client_messages import TokenLogprobs, TokenOutput
from protocol.prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class ChoiceDelta:
    """What one engine output added to one choice."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None  # with the first token, when asked
    kv_transfer_params: dict | None = None  # with the last, from a prefill engine (do_remote_decode)


@dataclass(slots=True)
class Choice:
    """A finished choice, every delta folded in (non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict | None = None

    def add(self, d: ChoiceDelta) -> None:
        if d.prompt_logprobs is not None:
            self.prompt_logprobs = d.prompt_logprobs
        if d.kv_transfer_params is not None:
            self.kv_transfer_params = d.kv_transfer_params
        self.text += d.text
        self.token_ids += d.token_ids
        if d.logprobs:
            self.logprobs += d.logprobs
        self.finish_reason, self.stop_reason = d.finish_reason, d.stop_reason
        self.num_cached_tokens = max(self.num_cached_tokens, d.num_cached_tokens)


class ChoiceState:
    """One choice's detokenizer and stop checks. ``finished`` once the engine request
    finished or a stop string ended the choice first (then the caller aborts it)."""

    __slots__ = ("index", "detok", "stop_ids", "finished")

    def __init__(self, tokenizer: Tokenizer, index: int, params: EngineParams, prompt_token_ids: list[int]):
        self.index = index
        self.detok = IncrementalDetokenizer(tokenizer, params.skip_special_tokens, params.stop, params.include_stop_str_in_output,
                                            params.generate["min_tokens"], prompt_token_ids, params.spaces_between_special_tokens)
        self.stop_ids = params.generate["stop_token_ids"]
        self.finished = False

    def feed(self, out: TokenOutput) -> ChoiceDelta:
        detok = self.detok
        # NOTE: an engine "stop" is a stop token (EOS, stop_token_ids): stop strings are the frontend's.
        stop_str = detok.update(out.new_token_ids, stop_terminated=out.finished and out.finish_reason == "stop")
        if stop_str is not None:
            finish_reason, stop_reason = "stop", stop_str
        else:
            finish_reason, stop_reason = out.finish_reason, None
            if finish_reason == "stop" and detok.token_ids and detok.token_ids[-1] in self.stop_ids:
                stop_reason = detok.token_ids[-1]
        finished = self.finished = stop_str is not None or out.finished
        return ChoiceDelta(self.index, detok.get_next_output_text(finished, delta=True), out.new_token_ids, out.logprobs,
                           finish_reason if finished else None, stop_reason, out.num_cached_tokens, out.prompt_logprobs,
                           out.kv_transfer_params)


async def run_choice(
    engine: EngineClient, tokenizer: Tokenizer, request_id: str, index: int, prompt_token_ids: list[int], params: EngineParams,
) -> AsyncIterator[ChoiceDelta]:
    state = ChoiceState(tokenizer, index, params, prompt_token_ids)
    stream = engine.generate(request_id, prompt_token_ids, params.generate)
    try:
        async for out in stream:
            yield state.feed(out)
            if state.finished:
                if not out.finished:  # a stop string ended it first
                    engine.abort([request_id], stopped=True)
                return
    finally:
        await stream.aclose()


def merge(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    """Every delta of every stream, as they come; the first error stops them all.
    NOTE: one stream (the common case) is returned as it is: no generator per token."""
    return streams[0] if len(streams) == 1 else _merge(streams)


async def _merge(streams: list[AsyncIterator[ChoiceDelta]]) -> AsyncIterator[ChoiceDelta]:
    queue: asyncio.Queue = asyncio.Queue()
    end = object()

    async def drain(s):
        try:
            async for d in s:
                queue.put_nowait(d)
        except Exception as e:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait(e)
        finally:
            queue.put_nowait(end)

    tasks = [asyncio.create_task(drain(s)) for s in streams]
    try:
        left = len(tasks)
        while left:
            item = await queue.get()
            if item is end:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
