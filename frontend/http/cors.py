"""CORS as vLLM has it: Starlette's CORSMiddleware (``starlette/middleware/cors.py``)
with ``--allowed-origins`` / ``--allowed-methods`` / ``--allowed-headers`` /
``--allow-credentials``, rebuilt for aiohttp.

A preflight (OPTIONS with Origin and Access-Control-Request-Method, on any path) is
answered here: 200 "OK", or 400 "Disallowed CORS origin, method, headers" naming what
failed, both with the preflight headers. Every other response gets the simple headers
when the request has an Origin, and ``Vary: Origin`` always, as Starlette adds them.
They are added as the response is prepared (``on_response_prepare``), so a stream gets
them too; a request the API-key check refused never reached this middleware and
gets none, as in vLLM.
"""

from __future__ import annotations

from aiohttp import web

ALL_METHODS = ("DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "QUERY")
SAFELISTED_HEADERS = {"Accept", "Accept-Language", "Content-Language", "Content-Type"}
MAX_AGE_S = 600
_PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"
_SEEN = web.RequestKey("kvpool_cors_seen", bool)  # the CORS middleware passed the request on


class Cors:
    def __init__(self, origins, methods, headers, credentials: bool):
        self.methods = ALL_METHODS if "*" in methods else tuple(methods)
        self.origins = tuple(origins)
        self.all_origins = "*" in self.origins
        self.all_headers = "*" in headers
        self.credentials = credentials
        self.explicit_origin = not self.all_origins or credentials
        self.simple = {}
        if self.all_origins:
            self.simple["Access-Control-Allow-Origin"] = "*"
        if credentials:
            self.simple["Access-Control-Allow-Credentials"] = "true"
        pre = {"Vary": _PREFLIGHT_VARY}
        if not self.explicit_origin:
            pre["Access-Control-Allow-Origin"] = "*"
        pre["Access-Control-Allow-Methods"] = ", ".join(self.methods)
        pre["Access-Control-Max-Age"] = str(MAX_AGE_S)
        allowed = sorted(SAFELISTED_HEADERS | set(headers))
        if not self.all_headers:
            pre["Access-Control-Allow-Headers"] = ", ".join(allowed)
        if credentials:
            pre["Access-Control-Allow-Credentials"] = "true"
        self.preflight_headers = pre
        self.allowed_headers = {h.lower() for h in allowed}

    def origin_allowed(self, origin: str) -> bool:
        return self.all_origins or origin in self.origins

    def preflight(self, request: web.Request) -> web.Response:
        origin = request.headers["Origin"]
        asked_headers = request.headers.get("Access-Control-Request-Headers")
        headers = dict(self.preflight_headers)
        failures = []
        if self.origin_allowed(origin):
            if self.explicit_origin:
                headers["Access-Control-Allow-Origin"] = origin
        else:
            failures.append("origin")
        if request.headers["Access-Control-Request-Method"] not in self.methods:
            failures.append("method")
        if self.all_headers and asked_headers is not None:
            headers["Access-Control-Allow-Headers"] = asked_headers
        elif asked_headers is not None and any(h.strip() not in self.allowed_headers for h in asked_headers.lower().split(",")):
            failures.append("headers")
        if request.headers.get("Access-Control-Request-Private-Network") is not None:
            failures.append("private-network")  # NOTE: Starlette's default: private network access is not allowed
        text = "Disallowed CORS " + ", ".join(failures) if failures else "OK"
        return web.Response(status=400 if failures else 200, text=text, headers=headers)

    def add_simple_headers(self, request: web.Request, response: web.StreamResponse) -> None:
        origin = request.headers.get("Origin")
        h = response.headers
        if origin is not None:
            h.update(self.simple)
        if origin is not None and (self.all_origins and self.credentials or not self.all_origins and self.origin_allowed(origin)):
            h["Access-Control-Allow-Origin"] = origin
        h["Vary"] = ", ".join([*h.getall("Vary", ()), "Origin"])


def install_cors(app: web.Application, cors: Cors):
    """Add ``cors`` to ``app``: returns the middleware, for the app's list."""

    async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
        if request.get(_SEEN):
            cors.add_simple_headers(request, response)

    app.on_response_prepare.append(on_prepare)

    @web.middleware
    async def cors_middleware(request: web.Request, handler):
        if request.method == "OPTIONS" and "Origin" in request.headers and "Access-Control-Request-Method" in request.headers:
            return cors.preflight(request)
        request[_SEEN] = True
        return await handler(request)

    return cors_middleware
