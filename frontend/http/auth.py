"""``--api-key`` (or ``VLLM_API_KEY``): vLLM's AuthenticationMiddleware
(``vllm/entrypoints/serve/middleware/authenticate.py``).

Only paths under vLLM's guarded prefixes need a key (after ``--root-path`` is taken
off): ``/health``, ``/metrics``, ``/tokenize``, ``/version``, ``/ping`` and
``/invocations`` stay open, as in vLLM. OPTIONS is never checked (a browser's CORS
preflight carries no credentials). A request without one of the keys gets vLLM's
401: ``{"error": "Unauthorized"}``, not OpenAI's error object, and no CORS headers
(vLLM's key check sits outside its CORS middleware).
"""

from __future__ import annotations

import hashlib
import secrets

from aiohttp import web

GUARDED_PREFIX = ("/v1", "/v2", "/inference", "/cohere")
_UNAUTHORIZED = b'{"error":"Unauthorized"}'


def _digest(token: str) -> bytes:
    # NOTE: surrogates (undecodable header bytes) must not raise: they match no key.
    return hashlib.sha256(token.encode("utf-8", "surrogatepass")).digest()


class ApiKeys:
    """The keys as SHA-256 digests, compared in constant time against every key (as
    vLLM: neither a key's length nor which key matched shows in the timing)."""

    def __init__(self, keys: tuple[str, ...]):
        self._digests = [_digest(k) for k in keys]

    def accepts(self, authorization: str | None) -> bool:
        if not authorization:
            return False
        scheme, _, param = authorization.partition(" ")
        if scheme.lower() != "bearer":
            return False
        given = _digest(param)
        match = False
        for digest in self._digests:
            match |= secrets.compare_digest(given, digest)
        return match


def guarded(path: str, root_path: str | None) -> bool:
    if root_path:
        path = path.removeprefix(root_path)
    return path.startswith(GUARDED_PREFIX)


def unauthorized() -> web.Response:
    return web.Response(status=401, body=_UNAUTHORIZED, content_type="application/json")


def auth_middleware(keys: tuple[str, ...], root_path: str | None):
    """The aiohttp middleware for ``keys``; the outermost of the app's (see module doc)."""
    api_keys = ApiKeys(keys)

    @web.middleware
    async def check_api_key(request: web.Request, handler):
        if request.method != "OPTIONS" and guarded(request.path, root_path) and not api_keys.accepts(request.headers.get("Authorization")):
            return unauthorized()
        return await handler(request)

    return check_api_key
