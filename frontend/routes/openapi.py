"""vLLM's docs routes, as FastAPI serves them for ``vllm serve``: ``GET /openapi.json``,
Swagger UI at ``/docs`` (with its ``/docs/oauth2-redirect``) and ReDoc at ``/redoc``;
none of them with ``--disable-fastapi-docs``, as vLLM's ``FastAPI(openapi_url=None,
docs_url=None, redoc_url=None)``.

The schema is vLLM 0.32's own, cut to the operations this server registers (which
depend on dev mode, ``VLLM_ALLOW_RUNTIME_LORA_UPDATING`` and
``--enable-tokenizer-info-endpoint`` here as in vLLM); kvpool's routes vLLM lacks
(vllm-router's probes, the cache pins) are not in it. Schema and pages are
``vllm_openapi_0.32.json``, written from vLLM's FastAPI app by
``tests/frontend/data/make_vllm_openapi.py``; nothing in it is written by hand.
With ``--root-path`` the schema names it in ``servers`` and the pages point under it,
as FastAPI's.
"""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
from aiohttp import web

DATA = Path(__file__).with_name("vllm_openapi_0.32.json")
ROOT_PATH = "{root_path}"  # where the pages name the root path (the generator put it there)
OPENAPI_PATH = "/openapi.json"
METHODS = ("get", "put", "post", "delete", "options", "head", "patch", "trace")


def references(node) -> set[str]:
    """The component names ``node`` refers to (``"$ref": "#/components/schemas/NAME"``)."""
    if isinstance(node, dict):
        found = {node["$ref"].rsplit("/", 1)[1]} if isinstance(node.get("$ref"), str) else set()
        return found.union(*(references(v) for v in node.values()))
    if isinstance(node, list):
        return set().union(*(references(v) for v in node))
    return set()


def cut(schema: dict, routes: set[tuple[str, str]]) -> dict:
    """``schema`` with only the operations in ``routes`` ((path, lower-case method)) and
    the component schemas they reach, in the schema's own order."""
    paths = {}
    for path, item in schema["paths"].items():
        ops = {k: v for k, v in item.items() if k not in METHODS or (path, k) in routes}
        if any(k in METHODS for k in ops):
            paths[path] = ops
    components = schema.get("components", {}).get("schemas", {})
    keep, todo = set(), references(paths)
    while todo:
        name = todo.pop()
        keep.add(name)
        todo |= references(components[name]) - keep
    out = {**schema, "paths": paths}
    out.pop("components", None)
    if keep:
        out["components"] = {**schema["components"], "schemas": {k: v for k, v in components.items() if k in keep}}
    return out


def docs_routes(routes: list[tuple[str, str, object]], root_path: str | None) -> list[tuple[str, str, object]]:
    """The docs routes for a server whose other routes are ``routes`` (method, path, handler)."""
    data = json.loads(DATA.read_text())
    root = (root_path or "").rstrip("/")
    schema = cut(data["schema"], {(path, method.lower()) for method, path, _ in routes})
    if root:
        schema = {**schema, "servers": [{"url": root}]}
    body = msgspec.json.encode(schema)
    pages = {path: html.replace(ROOT_PATH, root) for path, html in data["pages"].items()}

    async def openapi(_request: web.Request) -> web.Response:
        return web.Response(body=body, content_type="application/json")

    def page(html: str):
        async def handler(_request: web.Request) -> web.Response:
            return web.Response(text=html, content_type="text/html")

        return handler

    return [("GET", OPENAPI_PATH, openapi), *(("GET", path, page(html)) for path, html in pages.items())]
