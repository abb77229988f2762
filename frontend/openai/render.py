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

from frontend.openai.chat_prompt import chat_engine_input
from frontend.openai.serving import ServingContext, random_id
from frontend.openai.serving_completion import completion_engine_input
from frontend.sampling.params import EngineParams
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest


def _generate_request(ctx: ServingContext, request_id: str, token_ids: list[int], params: EngineParams, req) -> dict:
    """One vLLM ``GenerateRequest``, field for field (``kv_transfer_params`` as the request
    gave them, as vLLM's render passes them on unread)."""
    sampling = {**params.generate, "n": params.n, "stop": params.stop, "include_stop_str_in_output": params.include_stop_str_in_output,
                "skip_special_tokens": params.skip_special_tokens, "spaces_between_special_tokens": params.spaces_between_special_tokens}
    sampling.pop("cache_salt", None)
    sampling.pop("kv_transfer_params", None)
    # NOTE: vLLM's SamplingParams holds the words and the allowed ids as the request gave them
    if sampling.pop("bad_words_token_ids", None):
        sampling["bad_words"] = list(dict.fromkeys(req.bad_words))
    if "allowed_token_ids" in sampling:
        sampling["allowed_token_ids"] = req.allowed_token_ids
    priority = sampling.pop("priority")
    return {"request_id": request_id, "token_ids": token_ids, "features": None, "sampling_params": sampling, "model": ctx.config.served_model_name,
            "stream": req.stream, "stream_options": None, "cache_salt": req.cache_salt, "priority": priority,
            "kv_transfer_params": req.kv_transfer_params}


async def render_completion(ctx: ServingContext, req: CompletionRequest) -> list[dict]:
    prompts, _, _, params = await completion_engine_input(ctx, req)
    request_id = req.request_id or random_id("cmpl")
    return [_generate_request(ctx, f"{request_id}-{i}", ids, params, req) for i, ids in enumerate(prompts)]


async def render_chat(ctx: ServingContext, req: ChatCompletionRequest) -> dict:
    ids, _, _, params, _ = await chat_engine_input(ctx, req)
    return _generate_request(ctx, req.request_id or random_id("chatcmpl"), ids, params, req)
