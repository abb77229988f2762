"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the messages rendered
with the checkpoint's chat template, tokenized without special tokens (the template
wrote them), streamed as ``chat.completion.chunk`` deltas or answered whole."""

from __future__ import annotations

from dataclasses import replace

import msgspec
from aiohttp import web

from frontend.chat_template import ChatTemplateError, render_chat
from frontend.engine_client import EngineError
from frontend.error_middleware import REQUEST_ID_KEY
from frontend.errors import APIError, bad_request
from frontend.logprobs import chat_logprobs
from frontend.metrics import ChoiceGroups
from frontend.prompt_logprobs import (
    check_logprob_fields,
    model_vocab_size,
    num_prompt_logprobs,
    prompt_logprobs_json,
)
from frontend.protocol import ChatCompletionRequest
from frontend.sampling import (
    EngineParams,
    check_prompt_length,
    engine_params,
    output_budget,
    with_header_priority,
)
from frontend.serving import (
    ServingContext,
    cached_tokens,
    choice_requests,
    collect,
    end_sse,
    engine_error,
    json_response,
    now,
    response_id,
    send_error_event,
    send_event,
    start_sse,
    usage,
)  # fmt: skip
from frontend.streaming import ClientGone, StreamedChoices, TextChunk

_encode = msgspec.json.encode


def conversation(messages: list[dict]) -> list[dict]:
    """Messages as chat templates read them: text parts joined with new lines, as
    vLLM's "string" content format does."""
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m.get("role"), str):
            raise bad_request(f"messages[{i}] has no role", "messages")
        content = m.get("content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise bad_request(f"messages[{i}]: only text content parts are supported", "messages")
                texts.append(part["text"])
            content = "\n".join(texts)
        elif content is not None and not isinstance(content, str):
            raise bad_request(f"messages[{i}].content must be a string or a list of content parts", "messages")
        out.append({**m, "content": content})
    return out


# Variables render_chat sets itself: as vLLM's, they win over chat_template_kwargs.
_RENDER_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt")


def template_kwargs(defaults: dict, requested: dict | None) -> dict:
    """vLLM's ``ChatParams.with_defaults``: --default-chat-template-kwargs under the
    request's chat_template_kwargs, of which a null or "auto" value leaves the default."""
    requested = requested or {}
    if defaults:
        requested = defaults | {k: v for k, v in requested.items() if v is not None and not (isinstance(v, str) and v == "auto")}
    return {k: v for k, v in requested.items() if k not in _RENDER_VARIABLES}


def chat_prompt(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                tools=None, documents=None, chat_template_kwargs=None) -> list[int]:  # fmt: skip
    kwargs = template_kwargs(ctx.default_chat_template_kwargs, chat_template_kwargs)
    try:
        text = render_chat(ctx.tokenizer.chat_template, conversation(messages), ctx.tokenizer.special_tokens_map,
                           add_generation_prompt, tools, documents, **kwargs)  # fmt: skip
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages") from None
    return ctx.tokenizer.encode(text, add_special_tokens=add_special_tokens)


def chat_engine_input(ctx: ServingContext, req: ChatCompletionRequest, rendered=None) -> tuple[list[int], int, int | None, EngineParams]:
    """A checked chat request as the engine runs it: (prompt token ids, max_tokens,
    logprobs asked for or None, engine params). Shared by the endpoint and its render.
    ``rendered()``, if given, is called between the prompt's checks and the sampling
    fields' (where vLLM's request gets its id)."""
    check_logprob_fields(req, "top_logprobs")
    ctx.check_model(req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    ids = chat_prompt(ctx, req.messages, req.add_generation_prompt, req.add_special_tokens, req.tools, req.documents,
                      req.chat_template_kwargs)  # fmt: skip
    requested = req.max_completion_tokens or req.max_tokens
    check_prompt_length(len(ids), requested, ctx.max_model_len)
    if rendered is not None:
        rendered()
    max_tokens = output_budget(requested, len(ids), ctx.max_model_len, ctx.default_sampling, ctx.max_tokens_cap)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if num_logprobs == -1:  # vLLM's -1: the whole vocabulary (over any --max-logprobs this server allows)
        num_logprobs = model_vocab_size(ctx.model_path) or ctx.tokenizer.vocab_size
    params = engine_params(req, max_tokens, num_logprobs, ctx.default_sampling, ctx.max_n, ctx.max_logprobs)
    asked = req.prompt_logprobs
    if asked is None and getattr(req, "echo", False):  # NOTE: vLLM's chat echo asks for top_logprobs' worth
        asked = req.top_logprobs
    plp = num_prompt_logprobs(req, ctx, asked)
    if plp is not None:
        params = replace(params, generate={**params.generate, "prompt_logprobs": plp})
    return ids, max_tokens, num_logprobs, params


def chat_role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """vLLM's ``get_chat_request_role``: --response-role for a reply to the generation
    prompt, else (a continued message) the last message's role."""
    if req.add_generation_prompt:
        return ctx.response_role
    return str(req.messages[-1].get("role", ctx.response_role))


async def create_chat_completion(ctx: ServingContext, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
    request_id = response_id("chatcmpl", request, req.request_id)
    ctx.preflight(req.model, req.n)
    # NOTE: --log-error-stack's lines name the id from where vLLM's request has one
    ids, max_tokens, num_logprobs, params = chat_engine_input(ctx, req, lambda: request.__setitem__(REQUEST_ID_KEY, request_id))
    params = with_header_priority(params, request.headers)
    as_ids = bool(req.return_tokens_as_token_ids or ctx.return_tokens_as_token_ids)
    if req.stream:
        return await _stream(ctx, request, req, request_id, ids, params, num_logprobs, as_ids)

    choices = await collect(ctx, request_id, [ids], params)
    out = [{
        "index": c.index, "message": {"role": chat_role(ctx, req), "content": c.text, "tool_calls": []},
        "logprobs": chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, num_logprobs, as_ids) if num_logprobs is not None else None,
        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
    } for c in choices]  # fmt: skip
    if ctx.output_log is not None:
        for c in choices:
            if c.text:
                ctx.output_log.output(request_id, c.text, c.token_ids, c.finish_reason)
    return json_response({
        "id": request_id, "object": "chat.completion", "created": now(), "model": ctx.model_name, "choices": out,
        "usage": usage(len(ids), sum(len(c.token_ids) for c in choices), ctx.cached(cached_tokens(choices, params.n))),
        "system_fingerprint": None, "prompt_logprobs": prompt_logprobs_json(ctx.tokenizer, ids, choices[0].prompt_logprobs),
        "kv_transfer_params": None,
    })  # fmt: skip


async def _stream(ctx, request, req, request_id, ids, params, num_logprobs, as_ids) -> web.StreamResponse:
    created = now()
    include_usage, continuous = ctx.include_usage(req.stream_options)
    resp = await start_sse(request)
    generated = [0] * params.n
    cached = [0] * params.n
    texts = [""] * params.n if ctx.output_log is not None else None  # each choice's text, for --enable-log-outputs
    groups = ChoiceGroups(ctx.metrics, params.n, 1, params.generate["max_tokens"])
    recent: list[list[int]] = [[] for _ in range(params.n)]  # each choice's last output tokens: its logprobs' decoding context

    def chunk(choices: list[dict], use: dict | None = None) -> dict:
        c = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.model_name, "choices": choices}
        if use is not None:
            c["usage"] = use
        return c

    def choice(i, delta, lp=None, finish_reason=None, stop_reason=None) -> dict:
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason}

    text_chunk = TextChunk(lambda c: chunk([c]), lambda i, text: choice(i, {"content": text}))

    def render(d) -> bytes | None:
        i = d.index
        generated[i] += len(d.token_ids)
        cached[i] = max(cached[i], d.num_cached_tokens)
        if texts is not None:
            texts[i] += d.text
            ctx.output_log.delta(request_id, d.text, d.token_ids, d.finish_reason)
        lp = None
        if num_logprobs is not None and d.logprobs:
            lp = chat_logprobs(ctx.tokenizer, d.token_ids, d.logprobs, num_logprobs, as_ids, recent[i])
            recent[i] = (recent[i] + d.token_ids)[-4:]
        elif not d.text and d.finish_reason is None:
            return None  # NOTE: as vLLM, a token with no text yet is still sent when it has logprobs
        if d.finish_reason is not None:
            groups.finished(i, d.finish_reason, len(ids), generated[i])
        elif lp is None and not continuous:
            return text_chunk(i, d.text)  # the common chunk: only new text
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        use = usage(len(ids), sum(generated)) if continuous else None
        return _encode(chunk([choice(i, delta, lp, d.finish_reason, d.stop_reason)], use))

    try:
        # NOTE: as vLLM, the first chunk of every choice carries only the role.
        for i in range(params.n):
            first = {"index": i, "delta": {"role": chat_role(ctx, req), "content": ""}, "logprobs": None, "finish_reason": None}
            await send_event(resp, chunk([first], usage(len(ids), 0) if continuous else None))
        await StreamedChoices(ctx, request, resp, render).run(choice_requests(request_id, [ids], params))
        if include_usage:
            await send_event(resp, chunk([], usage(len(ids), sum(generated), ctx.cached(cached[0]))))
        if texts is not None:
            ctx.output_log.stream_end(request_id, texts)
    except ClientGone:
        return resp
    except EngineError as e:
        await send_error_event(resp, engine_error(e))
    except APIError as e:
        await send_error_event(resp, e)
    await end_sse(resp)
    return resp
