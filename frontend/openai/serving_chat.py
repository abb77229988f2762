"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the messages rendered
with the checkpoint's chat template, tokenized without special tokens (the template
wrote them), streamed as ``chat.completion.chunk`` deltas or answered whole."""

from __future__ import annotations

from dataclasses import replace

import msgspec
from aiohttp import web

from frontend.engine.outputs import EngineError
from frontend.engine.streaming import ClientGone, StreamedChoices, TextChunk
from frontend.http.error_middleware import REQUEST_ID_KEY
from frontend.http.metrics import ChoiceGroups
from frontend.openai.logprobs import chat_logprobs
from frontend.openai.prompt_logprobs import (
    check_logprob_fields,
    num_prompt_logprobs,
    prompt_logprobs_json,
    whole_vocabulary,
)
from frontend.openai.serving import (
    ServingContext,
    cached_tokens,
    choice_requests,
    collect,
    end_sse,
    engine_error,
    final_stream_usage,
    json_response,
    now,
    response_id,
    send_error_event,
    send_event,
    start_sse,
    stream_usage,
    usage,
)
from frontend.sampling.logits_fields import with_logits_fields
from frontend.sampling.params import (
    EngineParams,
    check_output_tokens,
    check_prompt_length,
    engine_params,
    output_budget,
    with_header_priority,
    with_kv_transfer_params,
)
from frontend.sampling.structured_outputs import with_structured_outputs
from frontend.schema.errors import APIError, bad_request
from frontend.schema.request_fields import check_routed_experts_start, check_unhonoured
from frontend.schema.requests import ChatCompletionRequest
from frontend.text.chat_messages import conversation
from frontend.text.chat_template import (
    NO_TEMPLATE,
    UNTRUSTED,
    ChatTemplateError,
    merge_kwargs,
    safe_apply_chat_template,
)
from frontend.text.chat_template import chat_template_kwargs as chat_template_kwargs_for
from frontend.text.content_format import detect_content_format
from frontend.text.truncation import check_truncation, tokens_kept, truncate_ids
from frontend.tools.calls import StreamedToolCalls, chat_message, logged_delta, logged_output
from frontend.tools.choice import check_tool_parsing, check_tool_usage, template_tools
from frontend.tools.constraint import adjust_request

_encode = msgspec.json.encode
# NOTE: vLLM 0.32's ChatMessage fields kvpool never fills, null in its answers as in vLLM's.
_MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}


def check_request_templates(ctx: ServingContext, chat_template: str | None, chat_template_kwargs: dict | None) -> None:
    """vLLM's ``validate_chat_template``: a template from the request only with --trust-request-chat-template."""
    if not ctx.config.trust_request_chat_template and (chat_template is not None or (chat_template_kwargs or {}).get("chat_template") is not None):
        raise bad_request(UNTRUSTED)


async def chat_prompt(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                      tools=None, documents=None, chat_template_kwargs=None, continue_final_message: bool = False,
                      chat_template: str | None = None, reasoning_effort: str | None = None) -> tuple[list[int], list[dict]]:
    """The prompt's token ids and the conversation rendered (vLLM's ``preprocess_chat``),
    in the tokenizer thread."""
    check_request_templates(ctx, chat_template, chat_template_kwargs)
    tok = ctx.tokenizer
    kwargs = chat_template_kwargs_for(ctx.config.default_chat_template_kwargs or {}, tools, chat_template_kwargs, add_generation_prompt,
                                      continue_final_message, documents, reasoning_effort)
    # NOTE: vLLM's order: the request's template, --chat-template, chat_template_kwargs' one, the checkpoint's.
    template = chat_template or (tok.chat_template if tok.chat_template_from_flag else None)
    kwargs = merge_kwargs(kwargs, {"chat_template": template})
    content_format = ctx.config.chat_template_content_format
    if content_format == "auto":  # NOTE: as vLLM, read from the template chat_template_kwargs' one would not replace
        resolved = tok.resolve_chat_template(template, kwargs.get("tools"))
        content_format = "string" if resolved is None else detect_content_format(resolved)
    chat = conversation(messages, content_format)
    try:
        out = await safe_apply_chat_template(tok, chat, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages" if str(e) == NO_TEMPLATE else None) from None
    except TypeError as e:  # a kwarg named like one of safe_apply_chat_template's own, as vLLM's 400
        raise bad_request(str(e)) from None
    if isinstance(out, str):
        out = await tok.encode_async(out, add_special_tokens=add_special_tokens)
    return out, chat


def check_generation_prompt(req) -> None:
    """vLLM's validator of a chat (or /tokenize) request's generation prompt."""
    # NOTE: as vLLM, only when both were sent; a default add_generation_prompt meets
    # transformers' own refusal when the template is applied.
    if req.continue_final_message and req.add_generation_prompt_sent is True:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def check_chat_fields(req: ChatCompletionRequest) -> None:
    """vLLM's request validators for what kvpool renders: the generation prompt and
    the multimodal kwargs it refuses without --trust-request-mm-kwargs (refused by
    kvpool's serve)."""
    check_generation_prompt(req)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, name):
            raise bad_request(f"Per-request {name} are disabled by default because they can change multimodal "
                              f"{'preprocessing' if name == 'mm_processor_kwargs' else 'media loading'} resource usage. "
                              f"Start the server with --trust-request-mm-kwargs only when clients are trusted. (parameter={name})", name)


async def chat_engine_input(ctx: ServingContext, req: ChatCompletionRequest,
                            rendered=None) -> tuple[list[int], int, int | None, EngineParams, list[dict]]:
    """A checked chat request as the engine runs it: (prompt token ids, max_tokens,
    logprobs asked for or None, engine params, the rendered conversation). Shared by
    the endpoint and its render. ``rendered()``, if given, is called between the
    prompt's checks and the sampling fields' (where vLLM's request gets its id)."""
    check_tool_usage(req)
    check_logprob_fields(req, "top_logprobs")
    ctx.check_model(req.model)
    check_unhonoured(req, "chat")
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.max_completion_tokens is not None:
        check_output_tokens(req.max_completion_tokens, ctx.config.max_model_len, "max_completion_tokens")
    else:
        check_output_tokens(req.max_tokens, ctx.config.max_model_len)
    check_truncation(req.truncate_prompt_tokens, ctx.config.max_model_len)
    check_chat_fields(req)
    check_tool_parsing(req, ctx.tool_parser)
    shown = None if req.tool_choice == "none" and ctx.config.exclude_tools_when_tool_choice_none else template_tools(req.tools)
    ids, chat = await chat_prompt(ctx, req.messages, req.add_generation_prompt, req.add_special_tokens, shown, req.documents,
                                  req.chat_template_kwargs, req.continue_final_message, req.chat_template, req.reasoning_effort)
    adjust_request(req, ctx.tool_parser, ctx.config.enforce_strict_tool_calling, ctx.config.tool_strict_level)
    requested = req.max_completion_tokens or req.max_tokens
    # NOTE: the rendered prompt's ids, sliced: vLLM's tokenizer-level truncation gives the
    # same unless add_special_tokens puts specials around a chat prompt. Truncated to
    # nothing, the prompt goes on for the engine to refuse (vLLM's words, in the stream).
    keep = tokens_kept(req.truncate_prompt_tokens, ctx.config.max_model_len,
                       req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
    ids = truncate_ids(ids, keep, req.truncation_side)
    check_prompt_length(len(ids), ctx.config.max_model_len, from_text=True)
    check_routed_experts_start(req, len(ids))
    if rendered is not None:
        rendered()
    max_tokens = output_budget(requested, len(ids), ctx.config.max_model_len, ctx.default_sampling, ctx.max_tokens_cap)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if num_logprobs == -1:  # vLLM's -1: the whole vocabulary (over any --max-logprobs this server allows)
        num_logprobs = whole_vocabulary(ctx)
    params = engine_params(req, max_tokens, num_logprobs, ctx.default_sampling, ctx.config.max_n_sequences, ctx.config.max_logprobs)
    asked = req.prompt_logprobs
    if asked is None and getattr(req, "echo", False):  # NOTE: vLLM's chat echo asks for top_logprobs' worth
        asked = req.top_logprobs
    plp = num_prompt_logprobs(req, ctx, asked)
    if plp is not None:
        params = replace(params, generate={**params.generate, "prompt_logprobs": plp})
    params = with_kv_transfer_params(params, req.kv_transfer_params, ctx.config.kv_transfer_config is not None)
    return ids, max_tokens, num_logprobs, with_logits_fields(params, req, ctx.tokenizer, ctx.vocab_size), chat


def echo_text(ctx: ServingContext, req: ChatCompletionRequest, chat: list[dict]) -> str:
    """vLLM's chat ``echo``: the last message's content, when its role is the reply's."""
    if not req.echo or not chat or chat[-1].get("role") != chat_role(ctx, req):
        return ""
    content = chat[-1].get("content") or ""
    return "\n".join(p["text"] for p in content) if isinstance(content, list) else content  # the "openai" format's parts


def chat_role(ctx: ServingContext, req: ChatCompletionRequest) -> str:
    """vLLM's ``get_chat_request_role``: --response-role for a reply to the generation
    prompt, else (a continued message) the last message's role."""
    if req.add_generation_prompt:
        return ctx.config.response_role
    return str(req.messages[-1].get("role", ctx.config.response_role))


async def create_chat_completion(ctx: ServingContext, request: web.Request, req: ChatCompletionRequest) -> web.StreamResponse:
    request_id = response_id("chatcmpl", request, req.request_id)
    check_tool_usage(req)  # NOTE: as vLLM's request validators, before the model is checked
    ctx.preflight(req.model, req.n)
    # NOTE: --log-error-stack's lines name the id from where vLLM's request has one
    ids, max_tokens, num_logprobs, params, chat = await chat_engine_input(ctx, req, lambda: request.__setitem__(REQUEST_ID_KEY, request_id))
    params = with_header_priority(params, request.headers)
    params = await with_structured_outputs(params, req)
    as_ids = bool(req.return_tokens_as_token_ids or ctx.config.return_tokens_as_token_ids)
    echo = echo_text(ctx, req, chat)
    if req.stream:
        return await _stream(ctx, request, req, request_id, ids, params, num_logprobs, as_ids, echo)

    choices = await collect(ctx, request_id, [ids], params)
    messages = [chat_message(ctx.tool_parser, ctx.tokenizer, req, chat_role(ctx, req), echo + c.text, c.finish_reason, not ctx.config.enforce_strict_tool_calling)
                for c in choices]
    out = [{
        "index": c.index, "message": {**_MESSAGE_NULLS, **message},
        "logprobs": chat_logprobs(ctx.tokenizer, c.token_ids, c.logprobs, num_logprobs, as_ids) if num_logprobs is not None else None,
        "finish_reason": finish_reason, "stop_reason": c.stop_reason, "token_ids": c.token_ids if req.return_token_ids else None,
        "routed_experts": None,  # NOTE: vLLM's MoE routing capture (--enable-return-routed-experts): never here
    } for c, (message, finish_reason) in zip(choices, messages, strict=True)]
    if ctx.output_log is not None:
        for c, (message, finish_reason) in zip(choices, messages, strict=True):
            if text := logged_output(message):
                ctx.output_log.output(request_id, text, c.token_ids, finish_reason)
    return json_response({
        "id": request_id, "object": "chat.completion", "created": now(), "model": ctx.config.served_model_name, "choices": out,
        "usage": usage(len(ids), sum(len(c.token_ids) for c in choices), ctx.cached(cached_tokens(choices, params.n))),
        "system_fingerprint": ctx.system_fingerprint, "prompt_logprobs": prompt_logprobs_json(ctx.tokenizer, ids, choices[0].prompt_logprobs),
        "prompt_token_ids": ids if req.return_token_ids else None, "prompt_text": None,
        "kv_transfer_params": choices[0].kv_transfer_params,  # a prefill engine's answer to vllm-router's PD mode
        "service_tier": None, "ec_transfer_params": None, "metrics": None,  # NOTE: vLLM 0.32's keys, null here as there
    })


def _choice(i, delta, lp=None, finish_reason=None, stop_reason=None, token_ids=None) -> dict:
    """One choice of a stream chunk. NOTE: as vLLM's (exclude_unset), stop_reason only on the chunk that finishes it."""
    if finish_reason is None:
        return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": None, "token_ids": token_ids}
    return {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish_reason, "stop_reason": stop_reason,
            "token_ids": token_ids}


async def _send_heads(resp, chunk, role: str, n: int, ids: list[int], with_ids: bool, continuous: bool, echo) -> None:
    """The chunks before any output: as vLLM, the first of every choice carries only the role
    (and names the prompt's ids, null unless return_token_ids); then, echoing, one chunk per choice."""
    def use() -> dict | None:
        return stream_usage(len(ids), 0, chat=True) if continuous else None

    for i in range(n):
        first = {"index": i, "delta": {"role": role, "content": ""}, "logprobs": None, "finish_reason": None}
        head = chunk([first], use())
        head["prompt_token_ids"], head["prompt_text"] = ids if with_ids else None, None
        await send_event(resp, head)
    if echo:
        for i in range(n):
            echoed = {"index": i, "delta": {"content": echo}, "logprobs": None, "finish_reason": None}
            await send_event(resp, chunk([echoed], use()))


async def _stream(ctx, request, req, request_id, ids, params, num_logprobs, as_ids, echo) -> web.StreamResponse:
    created = now()
    include_usage, continuous = ctx.include_usage(req.stream_options)
    resp = await start_sse(request)
    generated = [0] * params.n
    cached = [0] * params.n
    texts = [""] * params.n if ctx.output_log is not None else None  # each choice's text, for --enable-log-outputs
    groups = ChoiceGroups(ctx.metrics, params.n, 1, params.generate["max_tokens"])
    recent: list[list[int]] = [[] for _ in range(params.n)]  # each choice's last output tokens: its logprobs' decoding context

    def chunk(choices: list[dict], use: dict | None = None) -> dict:
        c = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": ctx.config.served_model_name, "choices": choices}
        if use is not None:
            c["usage"] = use
        # NOTE: as vLLM, the fingerprint rides on the last message: the usage chunk, else each finishing chunk
        if ctx.system_fingerprint and (not choices or (not include_usage and any(x.get("finish_reason") for x in choices))):
            c["system_fingerprint"] = ctx.system_fingerprint
        return c

    with_ids = bool(req.return_token_ids)

    text_chunk = TextChunk(lambda c: chunk([c]), lambda i, text: _choice(i, {"content": text}))
    # NOTE: with a tool parser (as vLLM's), every choice's text goes through its own parser.
    tools = [StreamedToolCalls(ctx.tool_parser, ctx.tokenizer, req, not ctx.config.enforce_strict_tool_calling) for _ in range(params.n)] if ctx.tool_parser else None

    def tool_chunk(d, lp, use) -> bytes | None:
        finished = d.finish_reason is not None
        delta = tools[d.index].delta(d.text, finished)
        if delta is None:
            if not finished and lp is None:
                return None
            delta = {}
        finish_reason = tools[d.index].finish_reason(d.finish_reason) if finished else None
        if texts is not None:
            ctx.output_log.delta(request_id, logged_delta(delta), d.token_ids, d.finish_reason)
        return _encode(chunk([_choice(d.index, delta, lp, finish_reason, d.stop_reason, d.token_ids if with_ids else None)], use))

    def render(d) -> bytes | None:
        i = d.index
        generated[i] += len(d.token_ids)
        cached[i] = max(cached[i], d.num_cached_tokens)
        if texts is not None:
            texts[i] += d.text
            if tools is None:  # NOTE: with a parser, what it made of the text is logged (tool_chunk)
                ctx.output_log.delta(request_id, d.text, d.token_ids, d.finish_reason)
        lp = None
        if num_logprobs is not None and d.logprobs:
            lp = chat_logprobs(ctx.tokenizer, d.token_ids, d.logprobs, num_logprobs, as_ids, recent[i])
            recent[i] = (recent[i] + d.token_ids)[-4:]
        if d.finish_reason is not None:
            groups.finished(i, d.finish_reason, len(ids), generated[i])
        if tools is not None:
            return tool_chunk(d, lp, stream_usage(len(ids), sum(generated), chat=True) if continuous else None)
        if lp is None and not d.text and d.finish_reason is None and not with_ids:
            return None  # NOTE: as vLLM, a token with no text yet is still sent when it has logprobs (or its ids)
        if d.finish_reason is None and lp is None and not continuous and not with_ids:
            return text_chunk(i, d.text)  # the common chunk: only new text
        delta = {"content": d.text} if d.text or d.finish_reason is None else {}
        use = stream_usage(len(ids), sum(generated), chat=True) if continuous else None
        token_ids = d.token_ids if with_ids else None
        return _encode(chunk([_choice(i, delta, lp, d.finish_reason, d.stop_reason, token_ids)], use))

    try:
        await _send_heads(resp, chunk, chat_role(ctx, req), params.n, ids, with_ids, continuous, echo)
        await StreamedChoices(ctx, request, resp, render).run(choice_requests(request_id, [ids], params))
        if include_usage:
            await send_event(resp, chunk([], final_stream_usage(len(ids), sum(generated), ctx.cached(cached[0]))))
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
