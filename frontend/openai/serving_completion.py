"""``POST /v1/completions`` (vLLM's ``OpenAIServingCompletion``): the prompt as a
string, a list of strings, a token-id list or a list of them; streamed
(frontend/openai/completion_stream.py) or answered whole."""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from frontend.http.error_middleware import REQUEST_ID_KEY
from frontend.openai.completion_stream import CompletionStream
from frontend.openai.prompt_logprobs import (
    check_logprob_fields,
    echoed_completion_logprobs,
    num_prompt_logprobs,
    prompt_logprobs_json,
    whole_vocabulary,
)
from frontend.openai.serving import (
    ServingContext,
    cached_tokens,
    collect,
    json_response,
    now,
    response_id,
    usage,
)
from frontend.sampling.logits_fields import with_logits_fields
from frontend.sampling.params import (
    EngineParams,
    check_output_tokens,
    check_prompt_chars,
    check_prompt_length,
    engine_params,
    output_budget,
    with_header_priority,
    with_kv_transfer_params,
)
from frontend.sampling.structured_outputs import with_structured_outputs
from frontend.schema.errors import bad_request
from frontend.schema.request_fields import check_routed_experts_start, check_unhonoured
from frontend.schema.requests import CompletionRequest
from frontend.text.truncation import check_truncation, encode_truncated, tokens_kept, truncate_ids


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


async def prompt_token_ids(ctx: ServingContext, req: CompletionRequest) -> tuple[list[list[int]], list[str | None]]:
    """Each prompt's token ids, and its text where it came as text."""
    p = req.prompt
    if isinstance(p, str) or (p and all(_is_token_id(t) for t in p)):
        p = [p]
    if not p:
        raise bad_request("Prompt cannot be empty", "prompt")
    if not all(isinstance(one, str) or (isinstance(one, list) and all(_is_token_id(t) for t in one)) for one in p):
        raise bad_request("prompt must be a string, a list of strings, a list of token ids or a list of token-id lists", "prompt")
    ids, texts = [], []
    keep, side = tokens_kept(req.truncate_prompt_tokens, ctx.config.max_model_len, req.max_tokens), req.truncation_side
    for one in p:
        if isinstance(one, str):
            if req.truncate_prompt_tokens is None:
                check_prompt_chars(one, ctx.config.max_model_len, ctx.tokenizer.max_chars_per_token)
            ids.append(await ctx.tokenizer.in_pool(lambda tok, one=one: encode_truncated(tok, one, req.add_special_tokens, keep, side)))
            texts.append(one)
        else:
            if not one:
                raise bad_request("Prompt cannot be empty", "prompt")
            ctx.check_token_ids(one)
            ids.append(truncate_ids(one, keep, side))
            texts.append(None)
    # NOTE: a prompt truncated to nothing goes on: the engine refuses it (vLLM's words,
    # in the stream as vLLM's engine does)
    return ids, texts


async def completion_engine_input(ctx: ServingContext, req: CompletionRequest,
                            rendered=None) -> tuple[list[list[int]], list[str | None], int, EngineParams]:
    """A checked completion request as the engine runs it: (each prompt's token ids,
    its text where one was given, max_tokens, engine params). Shared by the endpoint
    and its render. ``rendered()``, if given, is called between the prompts' checks and
    the sampling fields' (where vLLM's request gets its id)."""
    check_logprob_fields(req, "logprobs")
    ctx.check_model(req.model)
    check_unhonoured(req, "completion")
    if req.suffix is not None:
        raise bad_request("suffix is not currently supported", "suffix")
    check_output_tokens(req.max_tokens, ctx.config.max_model_len)
    check_truncation(req.truncate_prompt_tokens, ctx.config.max_model_len)
    prompts, texts = await prompt_token_ids(ctx, req)
    for ids, text in zip(prompts, texts, strict=True):
        check_prompt_length(len(ids), ctx.config.max_model_len, from_text=text is not None)
        check_routed_experts_start(req, len(ids))
    if rendered is not None:
        rendered()
    # NOTE: one budget for every prompt (they share EngineParams): the longest prompt's.
    max_tokens = output_budget(req.max_tokens, max(len(p) for p in prompts), ctx.config.max_model_len, ctx.default_sampling, ctx.max_tokens_cap)
    if req.echo and req.max_tokens == 0:
        max_tokens = 1  # NOTE: vLLM's echo without generation: one token is sampled, and only the prompt shown
    # vLLM's -1: the whole vocabulary (over any --max-logprobs this server allows)
    num_logprobs = req.logprobs if req.logprobs != -1 else whole_vocabulary(ctx)
    params = engine_params(req, max_tokens, num_logprobs, ctx.default_sampling, ctx.config.max_n_sequences, ctx.config.max_logprobs)
    plp = num_prompt_logprobs(req, ctx, req.prompt_logprobs if req.prompt_logprobs is not None or not req.echo else req.logprobs)
    if plp is not None:
        params = replace(params, generate={**params.generate, "prompt_logprobs": plp})
    params = with_kv_transfer_params(params, req.kv_transfer_params, ctx.config.kv_transfer_config is not None)
    return prompts, texts, max_tokens, with_logits_fields(params, req, ctx.tokenizer, ctx.vocab_size)


async def create_completion(ctx: ServingContext, request: web.Request, req: CompletionRequest) -> web.StreamResponse:
    request_id = response_id("cmpl", request, req.request_id)
    ctx.preflight(req.model, req.n)
    # NOTE: --log-error-stack's lines name the id from where vLLM's request has one
    prompts, texts, max_tokens, params = await completion_engine_input(ctx, req, lambda: request.__setitem__(REQUEST_ID_KEY, request_id))
    params = with_header_priority(params, request.headers)
    params = await with_structured_outputs(params, req)
    as_ids = bool(req.return_tokens_as_token_ids or ctx.config.return_tokens_as_token_ids)
    # NOTE: as vLLM, an echo with return_token_ids echoes the prompt's ids, not its text; a token
    # prompt echoes as vLLM decodes it: special tokens kept (transformers' default).
    echo = [(t if t is not None else ctx.tokenizer.decode(ids, skip_special_tokens=False)) if req.echo and not req.return_token_ids else ""
            for ids, t in zip(prompts, texts, strict=True)]
    n = params.n
    if req.stream:
        return await CompletionStream(ctx, req, request_id, prompts, params, echo, as_ids).run(request)

    choices = await collect(ctx, request_id, prompts, params)
    echo_only = req.echo and req.max_tokens == 0
    out = []
    for c in choices:
        prompt = prompts[c.index // n]
        lp = None
        if req.logprobs is not None:
            lp = echoed_completion_logprobs(ctx.tokenizer, req, prompt, c.prompt_logprobs, c.token_ids, c.logprobs, as_ids, echo_only)
        out.append({"index": c.index, "text": echo[c.index // n] + ("" if echo_only else c.text), "logprobs": lp,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason, "token_ids": c.token_ids if req.return_token_ids else None,
                    "prompt_logprobs": prompt_logprobs_json(ctx.tokenizer, prompt, c.prompt_logprobs),
                    "prompt_token_ids": prompt if req.return_token_ids else None, "routed_experts": None})
    num_prompt = sum(len(p) for p in prompts)
    return json_response({
        "id": request_id, "object": "text_completion", "created": now(), "model": ctx.config.served_model_name, "choices": out,
        "usage": usage(num_prompt, sum(len(c.token_ids) for c in choices), ctx.cached(cached_tokens(choices, n))),
        # NOTE: as vLLM, the first prompt's first choice's: a prefill engine's answer to vllm-router's PD mode
        "system_fingerprint": ctx.system_fingerprint, "kv_transfer_params": choices[0].kv_transfer_params,
        "service_tier": None, "ec_transfer_params": None, "metrics": None,  # NOTE: vLLM 0.32's keys, null here as there
    })

