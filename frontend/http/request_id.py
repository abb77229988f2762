"""``--enable-request-id-headers``: every response carries ``X-Request-Id``, as
vLLM's ``XRequestIdMiddleware``: the request's own X-Request-Id header if it sent
one, else a random uuid4 (hex). vLLM's middleware is the outermost, so refusals
(a missing API key, an unknown route) and CORS preflights carry it too; here it is
aiohttp's ``on_response_prepare`` signal, which every response passes as its headers
go out (a stream's too)."""

from __future__ import annotations

import uuid

from aiohttp import web

HEADER = "X-Request-Id"


async def _add_request_id(request: web.Request, response: web.StreamResponse) -> None:
    response.headers.add(HEADER, request.headers.get(HEADER, uuid.uuid4().hex))


def install_request_id_headers(app: web.Application) -> None:
    app.on_response_prepare.append(_add_request_id)
