"""What every endpoint shares: the served model, the tokenizer and engine client, the
request checks common to completions and chat, usage, and SSE framing."""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
from aiohttp import web

from frontend.config import FrontendConfig
from frontend.engine.client import EngineClient
from frontend.engine.generation import Choice, ChoiceDelta, merge, run_choice
from frontend.engine.outputs import EngineError
from frontend.engine.streaming import ClientGone, WriteBatch
from frontend.http.metrics import ChoiceGroups, FrontendMetrics
from frontend.openai.output_log import OutputLog
from frontend.sampling.params import EngineParams
from frontend.schema.errors import APIError, bad_request, model_not_found
from frontend.text.tokenizer import Tokenizer
from frontend.tools.parsers import ToolParser
from protocol.client_messages import MAX_REQUEST_ID_LENGTH

log = logging.getLogger("frontend")

_encode = msgspec.json.encode


@dataclass(slots=True)
class ServingContext:
    """What every handler reads: the process's flags by their own names (``config``) and
    what start-up built from them once."""

    config: FrontendConfig
    tokenizer: Tokenizer
    engine: EngineClient
    metrics: FrontendMetrics
    # The checkpoint's generation_config.json defaults (frontend.sampling.params.default_sampling).
    default_sampling: dict
    max_tokens_cap: int | None = None  # vLLM's override_max_tokens (frontend.sampling.params.max_tokens_cap)
    vocab_size: int | None = None  # the model's (config.json): vLLM's token-id checks
    # --enable-auto-tool-choice --tool-call-parser: the parser class (frontend.tools.parsers), else None.
    tool_parser: type[ToolParser] | None = None
    # Every answer's system_fingerprint (frontend.version); on a stream's last chunk only, as vLLM's.
    system_fingerprint: str | None = None
    output_log: OutputLog | None = None  # --enable-log-outputs (chat only, as vLLM)
    writes: WriteBatch = field(default_factory=WriteBatch)  # every stream's frames of a step

    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.config.served_model_name:
            raise model_not_found(model)

    def preflight(self, model: str | None, n: int | None) -> None:
        """vLLM's order: the model, then the queue limits (``_preflight``, with the
        request's n), before the prompt is rendered; a 503 before any stream starts."""
        self.check_model(model)
        self.engine.check_admission(n or 1)

    def cached(self, num_cached_tokens: int) -> int | None:
        """What a final usage reports as cached: the count with
        --enable-prompt-tokens-details, else None (no prompt_tokens_details, as vLLM)."""
        return num_cached_tokens if self.config.enable_prompt_tokens_details else None

    def include_usage(self, stream_options) -> tuple[bool, bool]:
        """vLLM's ``should_include_usage``: (a final usage chunk, usage in every chunk);
        --enable-force-include-usage turns both on, whatever the request asked."""
        if self.config.enable_force_include_usage:
            return True, True
        include = stream_options is not None and stream_options.include_usage
        return include, include and stream_options.continuous_usage_stats

    def check_token_ids(self, token_ids: list[int], param: str = "prompt") -> None:
        vocab = self.tokenizer.vocab_size
        bad = next((t for t in token_ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"Token id {bad} is out of vocabulary", param)


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def response_id(prefix: str, request: web.Request, body_id: str | None) -> str:
    """vLLM's ``f"{prefix}-{_base_request_id(raw_request, request.request_id)}"``: the
    request's X-Request-Id header (flag or not), else its body's request_id, else random."""
    base = request.headers.get("X-Request-Id")
    if base is None:
        base = body_id if body_id is not None else random_uuid()
    return f"{prefix}-{base}"


def random_uuid() -> str:
    """vLLM's ``random_uuid``: 16 hex digits (a request's default body request_id)."""
    return f"{uuid.uuid4().int & (2**64 - 1):016x}"


def now() -> int:
    return int(time.time())


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage; ``prompt_tokens_details`` only given ``cached_tokens`` (see
    ``ServingContext.cached``; vLLM's continuous-usage chunks have none either)."""
    details = None if cached_tokens is None else {"cached_tokens": cached_tokens, "created_cache_tokens": None, "multimodal_tokens": None}
    return {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens,
            "completion_tokens": completion_tokens, "prompt_tokens_details": details, "completion_tokens_details": None}


def stream_usage(prompt_tokens: int, completion_tokens: int, chat: bool) -> dict:
    """A streamed chunk's running usage (continuous_usage_stats), keyed as vLLM 0.32
    serializes it (exclude_unset): chat's sets completion_tokens_details (null)."""
    use = {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens + completion_tokens, "completion_tokens": completion_tokens}
    if chat:
        use["completion_tokens_details"] = None
    return use


def final_stream_usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """A stream's last chunk's usage, as vLLM 0.32 serializes it (exclude_none): no null keys."""
    return {k: v for k, v in usage(prompt_tokens, completion_tokens, cached_tokens).items() if v is not None}


def stream_chunk(ctx: ServingContext, obj: str, request_id: str, created: int, include_usage: bool, choices: list[dict],
                 use: dict | None = None) -> dict:
    """One streamed chunk (``obj``: "chat.completion.chunk" or "text_completion")."""
    c = {"id": request_id, "object": obj, "created": created, "model": ctx.config.served_model_name, "choices": choices}
    if use is not None:
        c["usage"] = use
    # NOTE: as vLLM, the fingerprint rides on the last message: the usage chunk, else each finishing chunk
    if ctx.system_fingerprint and (not choices or (not include_usage and any(x.get("finish_reason") for x in choices))):
        c["system_fingerprint"] = ctx.system_fingerprint
    return c


def choice_requests(request_id: str, prompts: list[list[int]], params: EngineParams) -> list[tuple[str, int, list[int], EngineParams]]:
    """n engine requests per prompt, as (engine request id, choice index, prompt,
    params): choice i * n + j is prompt i's j-th sample (seeded samples get seed + j,
    as vLLM's ParentRequest does).

    NOTE: an engine request id ends in a random suffix, as vLLM's internal ids do: the
    response id comes from the client (X-Request-Id, the body's request_id), and a retry
    or a router may send the same one while the first is still running. The client's
    id is cut to what the engine message carries (``RequestId``): vLLM takes an id of
    any length, and the suffix alone keeps the engine ids apart."""
    suffix = uuid.uuid4().hex[:8]
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(params.n):
            tail = f"-{i * params.n + j}-{suffix}"
            p = params
            if params.n > 1 and params.generate["seed"] is not None:
                p = dataclasses.replace(params, generate={**params.generate, "seed": params.generate["seed"] + j})
            index = i * params.n + j
            out.append((request_id[:MAX_REQUEST_ID_LENGTH - len(tail)] + tail, index, prompt, p))
    return out


def choice_streams(ctx: ServingContext, request_id: str, prompts: list[list[int]], params: EngineParams) -> list[AsyncIterator[ChoiceDelta]]:
    """Each choice as an async iterator of its deltas."""
    if ctx.config.enable_log_requests:
        log.info("Received request %s: params: %s, n: %d, num_prompt_tokens: %s.", request_id, params.generate, params.n,
                 [len(p) for p in prompts])
    if params.refusal is not None:
        raise params.refusal
    # vLLM's add_request check, prompt by prompt, before any starts (frontend/engine/admission.py)
    ctx.engine.check_admission_prompts([len(p) for p in prompts], params.n)
    return [run_choice(ctx.engine, ctx.tokenizer, rid, index, prompt, p)
            for rid, index, prompt, p in choice_requests(request_id, prompts, params)]


async def collect(ctx: ServingContext, request_id: str, prompts: list[list[int]], params: EngineParams) -> list[Choice]:
    """Run every choice to its end (non-streaming)."""
    choices = [Choice(i) for i in range(len(prompts) * params.n)]
    try:
        async for d in merge(choice_streams(ctx, request_id, prompts, params)):
            choices[d.index].add(d)
    except EngineError as e:
        raise engine_error(e) from None
    groups = ChoiceGroups(ctx.metrics, params.n, len(prompts), params.generate["max_tokens"])
    for c, prompt in zip(choices, (p for p in prompts for _ in range(params.n)), strict=True):
        groups.finished(c.index, c.finish_reason, len(prompt), len(c.token_ids))
    return choices


# NOTE: refusals that are the server's state, not the request's: 503 (with Retry-After),
# which the openai SDK and routers retry, as vLLM answers overload; all else is 400.
_UNAVAILABLE = ("lost the connection", "no worker", "the waiting queue is full", "the scheduler is shutting down", "the server is stopping")


def engine_error(e: EngineError) -> APIError:
    """A scheduler refusal is the request's fault (400, its message), unless the server
    is lost, without a worker, full or stopping (503)."""
    message = str(e)
    if any(m in message for m in _UNAVAILABLE):
        return APIError(message, 503)
    return bad_request(message, e.param)


def cached_tokens(choices, n: int) -> int:
    """Prompt tokens found in the prefix cache: the first sample's of each prompt."""
    return sum(c.num_cached_tokens for c in choices[::n])


async def start_sse(request: web.Request) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
    await resp.prepare(request)
    await resp.write(b"")  # NOTE: sends the headers now (aiohttp holds them for the first body write)
    return resp


async def send_event(resp: web.StreamResponse, data: dict) -> None:
    await resp.write(b"data: " + _encode(data) + b"\n\n")


async def send_error_event(resp: web.StreamResponse, error: APIError) -> None:
    log.info("a stream ended with %d: %s", error.status.value, error.message)
    # NOTE: headers are gone once streaming: vLLM sends the error object as an event.
    await send_event(resp, error.body())


async def end_sse(resp: web.StreamResponse) -> None:
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()


async def serve_sse(request: web.Request, send: Callable[[web.StreamResponse], Awaitable[None]]) -> web.StreamResponse:
    """A streamed answer: ``send`` writes its events; an engine or API error is the last event
    before ``[DONE]``, and a client gone ends it without one (nothing is listening)."""
    resp = await start_sse(request)
    try:
        await send(resp)
    except ClientGone:
        return resp
    except EngineError as e:
        await send_error_event(resp, engine_error(e))
    except APIError as e:
        await send_error_event(resp, e)
    await end_sse(resp)
    return resp


def json_response(data: dict) -> web.Response:
    return web.Response(body=_encode(data), content_type="application/json")
