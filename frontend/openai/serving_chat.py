"""``POST /v1/chat/completions`` (vLLM's ``OpenAIServingChat``): the request made the
engine's input (frontend/openai/chat_prompt.py), then streamed as
``chat.completion.chunk`` deltas (frontend/openai/chat_stream.py) or answered whole."""

from __future__ import annotations

from aiohttp import web

from frontend.http.error_middleware import REQUEST_ID_KEY
from frontend.openai.chat_prompt import chat_engine_input
from frontend.openai.chat_stream import ChatStream
from frontend.openai.logprobs import chat_logprobs
from frontend.openai.prompt_logprobs import prompt_logprobs_json
from frontend.openai.serving import (
    ServingContext,
    cached_tokens,
    collect,
    json_response,
    now,
    response_id,
    usage,
)
from frontend.sampling.params import with_header_priority
from frontend.sampling.structured_outputs import with_structured_outputs
from frontend.schema.requests import ChatCompletionRequest
from frontend.tools.calls import chat_message, logged_output
from frontend.tools.choice import check_tool_usage

# NOTE: vLLM 0.32's ChatMessage fields kvpool never fills, null in its answers as in vLLM's.
MESSAGE_NULLS = {"refusal": None, "annotations": None, "audio": None, "function_call": None, "reasoning": None}


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
        return await ChatStream(ctx, req, request_id, ids, params, num_logprobs, as_ids).run(request, chat_role(ctx, req), echo)

    choices = await collect(ctx, request_id, [ids], params)
    messages = [chat_message(ctx.tool_parser, ctx.tokenizer, req, chat_role(ctx, req), echo + c.text, c.finish_reason, not ctx.config.enforce_strict_tool_calling)
                for c in choices]
    out = [{
        "index": c.index, "message": {**MESSAGE_NULLS, **message},
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
