"""vLLM's docs routes (frontend/routes/openapi.py): ``/openapi.json`` is vLLM 0.32's schema cut to
the operations the app registers, which follow the same flags as in vLLM; ``/docs``,
``/docs/oauth2-redirect`` and ``/redoc`` are FastAPI's pages; ``--root-path`` goes into
``servers`` and the pages' links as FastAPI puts it; ``--disable-fastapi-docs`` removes all
four. The app itself on a free port (no engine: these routes never reach it)."""

from __future__ import annotations

import asyncio
import json

from aiohttp.test_utils import TestClient, TestServer
from kvtest.ports import free_port

from frontend.api_server import APIServer
from frontend.config import FrontendConfig
from frontend.routes.openapi import DATA, METHODS, cut, references

DOCS = ("/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")
ALL_ROUTES_ON = {"dev_mode": True, "allow_runtime_lora_updating": True, "enable_tokenizer_info_endpoint": True}


def _app_answers(model: str, paths: tuple[str, ...], **flags) -> tuple[set[tuple[str, str]], list[tuple[int, str, str]]]:
    """The (path, method) routes of the app built from ``flags``, and its GET answers to ``paths``."""

    async def run():
        app = APIServer(FrontendConfig(model, "tiny", **flags)).build_app()
        routes = {(r.resource.canonical, r.method.lower()) for r in app.router.routes()}
        out = []
        async with TestClient(TestServer(app, port=free_port())) as client:
            for path in paths:
                r = await client.get(path)
                out.append((r.status, r.content_type, await r.text()))
        return routes, out

    return asyncio.run(run())


def _operations(schema: dict) -> set[tuple[str, str]]:
    return {(path, method) for path, item in schema["paths"].items() for method in item if method in METHODS}


def test_the_schema_is_vllms_for_the_routes_the_app_has(tiny_checkpoint):
    routes, [(status, content_type, body)] = _app_answers(str(tiny_checkpoint), ("/openapi.json",), **ALL_ROUTES_ON)
    served, committed = json.loads(body), json.loads(DATA.read_text())["schema"]
    assert (status, content_type) == (200, "application/json")
    assert served == committed and "servers" not in served  # every route on: the whole file
    assert served["info"] == {"title": "FastAPI", "version": "0.1.0"} and served["openapi"] == "3.1.0"
    assert _operations(served) <= routes  # nothing the app does not serve
    assert {("/v1/completions", "post"), ("/v1/chat/completions", "post"), ("/reset_prefix_cache", "post"),
            ("/v1/load_lora_adapter", "post"), ("/tokenizer_info", "get")} <= _operations(served)
    assert ("/v1/cache/pin", "post") in routes and "/v1/cache/pin" not in served["paths"]  # kvpool's own: not vLLM's
    assert references(served) == set(served["components"]["schemas"])  # no reference dangles, no schema unused


def test_the_schema_follows_the_routes_the_flags_turn_on(tiny_checkpoint):
    routes, [(_, _, body)] = _app_answers(str(tiny_checkpoint), ("/openapi.json",))
    schema = json.loads(body)
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize", "/metrics"} <= set(schema["paths"])
    assert not {"/reset_prefix_cache", "/v1/load_lora_adapter", "/v1/unload_lora_adapter", "/tokenizer_info"} & set(schema["paths"])
    assert "LoadLoRAAdapterRequest" not in schema["components"]["schemas"]
    assert _operations(schema) <= routes and references(schema) == set(schema["components"]["schemas"])


def test_the_docs_pages_and_the_root_path(tiny_checkpoint):
    _, plain = _app_answers(str(tiny_checkpoint), DOCS[1:])
    assert all(status == 200 and content_type == "text/html" for status, content_type, _ in plain)
    assert "SwaggerUIBundle" in plain[0][2] and "url: '/openapi.json'" in plain[0][2]
    assert "window.location.origin + '/docs/oauth2-redirect'" in plain[0][2]
    assert 'spec-url="/openapi.json"' in plain[2][2] and "{root_path}" not in "".join(page for _, _, page in plain)
    _, rooted = _app_answers(str(tiny_checkpoint), ("/api/openapi.json", "/openapi.json", "/api/docs", "/redoc"), root_path="/api")
    assert [status for status, _, _ in rooted] == [200] * 4
    assert json.loads(rooted[0][2])["servers"] == [{"url": "/api"}] and rooted[0][2] == rooted[1][2]
    assert "url: '/api/openapi.json'" in rooted[2][2] and "origin + '/api/docs/oauth2-redirect'" in rooted[2][2]
    assert 'spec-url="/api/openapi.json"' in rooted[3][2]


def test_disable_fastapi_docs_removes_them(tiny_checkpoint):
    routes, answers = _app_answers(str(tiny_checkpoint), DOCS, disable_fastapi_docs=True)
    assert [status for status, _, _ in answers] == [404] * 4
    assert not {path for path, _ in routes} & set(DOCS)


def test_cut_keeps_the_components_reached_through_others():
    ref = {"$ref": "#/components/schemas/A"}
    schema = {"paths": {"/a": {"post": {"requestBody": ref}, "get": {}}, "/b": {"get": {"x": {"$ref": "#/components/schemas/C"}}}},
              "components": {"schemas": {"A": {"items": {"$ref": "#/components/schemas/B"}}, "B": {}, "C": {}}}}
    out = cut(schema, {("/a", "post")})
    assert out["paths"] == {"/a": {"post": {"requestBody": ref}}} and set(out["components"]["schemas"]) == {"A", "B"}
    assert "components" not in cut(schema, {("/a", "get")})
