"""``POST /invocations`` (SageMaker), as vLLM 0.32 routes it
(``vllm/entrypoints/serve/sagemaker/api_router.py``): by the body's shape, a chat
request first, else a completion. A JSON object that is no chat request goes to
completions, whose own checks answer it (vLLM's CompletionRequest accepts any
object and refuses it later); anything else is vLLM's "Cannot find suitable
handler". The body must be ``application/json``, as vLLM's ``validate_json_request``.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import msgspec
from aiohttp import web

from frontend.http.request_body import decode, read_bytes
from frontend.schema.errors import APIError
from frontend.schema.requests import ChatCompletionRequest, CompletionRequest

_HANDLER_NAMES = "['ChatCompletionRequest', 'CompletionRequest']"


def _decode(body: bytes, type_):
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError:
        return None


def invocations_route(completion: Callable[[web.Request, CompletionRequest], Awaitable[web.StreamResponse]],
                      chat: Callable[[web.Request, ChatCompletionRequest], Awaitable[web.StreamResponse]]) -> tuple[str, str, object]:
    """``completion`` and ``chat``: the generating endpoints' handlers of a decoded request."""
    async def invocations(request: web.Request) -> web.StreamResponse:
        media_type = request.headers.get("Content-Type", "").split(";", 1)[0].strip().lower()
        if media_type != "application/json":
            raise APIError("1 validation error:\n  Unsupported Media Type: Only 'application/json' is allowed", 400,
                           type_="Bad Request")
        body = await read_bytes(request)
        try:
            value = json.loads(body)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise APIError(f"JSON decode error: {e}", 400, type_="Bad Request") from None
        if (chat_req := _decode(body, ChatCompletionRequest)) is not None:
            return await chat(request, chat_req)
        if not isinstance(value, dict):
            raise APIError(f"Cannot find suitable handler for request. Expected one of: {_HANDLER_NAMES}", 400)
        completion_req = _decode(body, CompletionRequest)
        if completion_req is None:
            # NOTE: the completion endpoint's own refusal (which field is wrong).
            completion_req = decode(body, CompletionRequest)
        return await completion(request, completion_req)

    return ("POST", "/invocations", invocations)
