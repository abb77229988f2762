"""POST /v1/cache/pin and /v1/cache/unpin: pinned prefixes, a kvpool extension
(vLLM has no such route; behind --api-key like every /v1 route).

Body: ``{"model"?, "prompt" | "prompt_token_ids", "ttl_s"?, "cache_salt"?,
"add_special_tokens"?}``; a text prompt is tokenized as /v1/completions does, so
the pinned blocks are the ones a completion of that prompt hits. Pin answers
``{"pinned_blocks": n, "pinned_tokens": t}``: the prompt's full blocks, held by
the pool until unpinned, ``ttl_s`` later, or a prefix-cache reset or lost worker
clears every pin. Blocks not cached yet are computed first, by a one-token
generation of the prompt (an ordinary request: it counts in the metrics like
any), then pinned. Beyond --max-pinned-fraction: a 400 and nothing pinned.
Unpin answers ``{"unpinned_blocks": n, "unpinned_tokens": t}``.
"""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontend.engine.scheduler_http import SchedulerHTTP
from frontend.http.request_body import read_body
from frontend.openai.serving import ServingContext, json_response, random_id
from frontend.schema.errors import APIError, bad_request
from protocol.client_messages import PinPrefix, PinResult


class PinRequest(msgspec.Struct, kw_only=True, forbid_unknown_fields=True):
    model: str | None = None
    prompt: str | list[int] | None = None
    prompt_token_ids: list[int] | None = None
    ttl_s: float | None = None
    cache_salt: str | None = None
    add_special_tokens: bool = True


_result = msgspec.json.Decoder(PinResult)


async def _token_ids(ctx: ServingContext, req: PinRequest) -> list[int]:
    if (req.prompt is None) == (req.prompt_token_ids is None):
        raise bad_request("give exactly one of prompt and prompt_token_ids", "prompt")
    if isinstance(req.prompt, str):
        if not req.prompt:
            raise bad_request("Prompt cannot be empty", "prompt")
        ids = await ctx.tokenizer.in_pool(lambda tok: tok.encode(req.prompt, add_special_tokens=req.add_special_tokens))
    else:
        param = "prompt" if req.prompt is not None else "prompt_token_ids"
        ids = req.prompt if req.prompt is not None else req.prompt_token_ids
        if not ids:
            raise bad_request("Prompt cannot be empty", param)
        ctx.check_token_ids(ids, param)
    if len(ids) >= ctx.config.max_model_len:
        raise bad_request(f"the prompt has {len(ids)} tokens; a pinned prompt must leave room for one more token "
                          f"within max_model_len {ctx.config.max_model_len}", "prompt")
    return ids


async def _ask(scheduler: SchedulerHTTP, path: str, body: PinPrefix) -> PinResult:
    status, text = await scheduler.post(path, msgspec.json.encode(body))
    if status == 400:
        raise bad_request(msgspec.json.decode(text).get("error", text.decode()), "prompt")
    if status != 200:
        raise APIError(f"the scheduler could not {path.rsplit('/', 1)[1]} ({status}): {text.decode(errors='replace')}", 503)
    return _result.decode(text)


def cache_pin_routes(ctx: ServingContext, scheduler: SchedulerHTTP) -> list[tuple[str, str, object]]:
    async def read(request: web.Request) -> tuple[PinRequest, list[int]]:
        req = await read_body(request, PinRequest)
        ctx.check_model(req.model)
        if req.ttl_s is not None and not 0 < req.ttl_s < float("inf"):
            raise bad_request(f"ttl_s must be a positive number of seconds, got {req.ttl_s}", "ttl_s")
        return req, await _token_ids(ctx, req)

    async def pin(request: web.Request) -> web.Response:
        req, ids = await read(request)
        body = PinPrefix(ids, req.cache_salt, req.ttl_s)
        out = await _ask(scheduler, "/v1/cache/pin", body)
        if out.missing_blocks:
            # NOTE: compute the prompt's blocks as any request would, then pin them.
            params = {"max_tokens": 1, "cache_salt": req.cache_salt} if req.cache_salt is not None else {"max_tokens": 1}
            async for _ in ctx.engine.generate(random_id("pin"), ids, params):
                pass
            out = await _ask(scheduler, "/v1/cache/pin", body)
            if out.missing_blocks:
                raise APIError("the prompt's blocks were evicted before they could be pinned (the pool is busy): retry", 503)
        if out.pinned_blocks == 0:
            raise bad_request(f"the prompt ({len(ids)} tokens) holds no full KV block of {out.block_size} tokens: nothing to pin", "prompt")
        return json_response({"pinned_blocks": out.pinned_blocks, "pinned_tokens": out.pinned_tokens})

    async def unpin(request: web.Request) -> web.Response:
        req, ids = await read(request)
        out = await _ask(scheduler, "/v1/cache/unpin", PinPrefix(ids, req.cache_salt))
        return json_response({"unpinned_blocks": out.pinned_blocks, "unpinned_tokens": out.pinned_tokens})

    return [("POST", "/v1/cache/pin", pin), ("POST", "/v1/cache/unpin", unpin)]
