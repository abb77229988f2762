"""``POST /v1/completions/render`` and ``/v1/chat/completions/render`` (vLLM's
``ServingRender``): a request turned into what the engine would run -- its prompt's
token ids and its sampling parameters -- without running it.

vLLM answers a completion with a list of its ``GenerateRequest`` (one per prompt) and
a chat with one. vllm-router's ``cache_aware`` policy asks for this before routing a
request (falling back to ``/tokenize`` without it), so a router places requests by
the same token ids the engine caches. The request is checked as the real endpoint
checks it (model, prompt, lengths, sampling fields), so a bad one is refused here
with the same error.
"""

from __future__ import annotations

from frontend.errors import bad_request
from frontend.protocol import ChatCompletionRequest, CompletionRequest
from frontend.sampling import EngineParams, check_prompt_length, engine_params
from frontend.serving import ServingContext, random_id
from frontend.serving_chat import chat_prompt
from frontend.serving_completion import prompt_token_ids


def _generate_request(ctx: ServingContext, request_id: str, token_ids: list[int], params: EngineParams, req) -> dict:
    """One vLLM ``GenerateRequest``, field for field."""
    sampling = {**params.generate, "n": params.n, "stop": params.stop, "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": params.skip_special_tokens}  # fmt: skip
    sampling.pop("cache_salt", None)
    return {"request_id": request_id, "token_ids": token_ids, "features": None, "sampling_params": sampling, "model": ctx.model_name,
            "stream": req.stream, "stream_options": None, "cache_salt": req.cache_salt, "priority": 0, "kv_transfer_params": None}  # fmt: skip


def render_completion(ctx: ServingContext, req: CompletionRequest) -> list[dict]:
    ctx.check_model(req.model)
    prompts, _ = prompt_token_ids(ctx, req)
    for ids in prompts:
        check_prompt_length(len(ids), req.max_tokens, ctx.max_model_len)
    max_tokens = req.max_tokens if req.max_tokens is not None else ctx.max_model_len - max(len(p) for p in prompts)
    params = engine_params(req, max_tokens, req.logprobs, ctx.default_sampling)
    request_id = req.request_id or random_id("cmpl")
    return [_generate_request(ctx, f"{request_id}-{i}", ids, params, req) for i, ids in enumerate(prompts)]


def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> dict:
    ctx.check_model(req.model)
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    ids = chat_prompt(ctx, req.messages, req.add_generation_prompt, req.add_special_tokens, req.tools, req.documents,
                      req.chat_template_kwargs)  # fmt: skip
    requested = req.max_completion_tokens or req.max_tokens
    check_prompt_length(len(ids), requested, ctx.max_model_len)
    max_tokens = requested if requested is not None else ctx.max_model_len - len(ids)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    params = engine_params(req, max_tokens, num_logprobs, ctx.default_sampling)
    return _generate_request(ctx, req.request_id or random_id("chatcmpl"), ids, params, req)
