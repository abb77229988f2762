"""A request's JSON body, read and decoded: 413 over ``--max-request-body-bytes``
(aiohttp refuses it unread), msgspec's message naming the wrong field otherwise."""

from __future__ import annotations

import msgspec
from aiohttp import web

from frontend.schema.errors import APIError

MAX_BODY_KEY = web.AppKey("max_request_body_bytes", int)  # the limit, for the 413's message


class RequestValidationError(APIError):
    """A body that is not the endpoint's JSON (FastAPI's RequestValidationError in vLLM)."""


async def read_bytes(request: web.Request) -> bytes:
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        limit = request.app[MAX_BODY_KEY]
        raise APIError(f"Request body too large: over the limit of {limit} bytes (--max-request-body-bytes).", 413) from None


def decode(body: bytes, type_):
    try:
        return msgspec.json.decode(body, type=type_)
    except msgspec.ValidationError as e:
        raise RequestValidationError(f"Invalid request: {e}") from None
    except msgspec.DecodeError as e:
        raise RequestValidationError(f"JSON decode error: {e}") from None


async def read_body(request: web.Request, type_):
    return decode(await read_bytes(request), type_)
