"""CORS as vLLM has it (Starlette's CORSMiddleware, its answers checked against a
running `vllm serve`): preflights answered on any path, 400 "Disallowed CORS ..."
naming what failed; simple responses (streams too) get the allow headers for an
allowed origin only, and `Vary: Origin` always. A real `python -m frontend` for an
explicit origin list with credentials; the app itself on a free port for the others."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from aiohttp.test_utils import TestClient, TestServer
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.ports import free_port

from frontend.api_server import APIServer
from frontend.config import FrontendConfig

ALL = "DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT, QUERY"
PREFLIGHT_VARY = "Origin, Access-Control-Request-Method, Access-Control-Request-Headers, Access-Control-Request-Private-Network"


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("cors") / "frontend.log"
    flags = ("--allowed-origins", '["http://a.example", "http://b.example"]', "--allow-credentials")
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, *flags) as f:
        yield f


def call(base_url: str, method: str, path: str, headers: dict, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(base_url + path, data=data, method=method, headers={"Content-Type": "application/json", **headers})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def preflight(origin: str, method: str = "POST", headers: str | None = None) -> dict:
    h = {"Origin": origin, "Access-Control-Request-Method": method}
    return h if headers is None else {**h, "Access-Control-Request-Headers": headers}


def test_explicit_origins_with_credentials(front, tiny_checkpoint):
    status, h, body = call(front.base_url, "OPTIONS", "/v1/completions", preflight("http://b.example", "POST", "authorization, x-foo"))
    assert (status, body) == (200, b"OK")
    assert h["Access-Control-Allow-Origin"] == "http://b.example" and h["Access-Control-Allow-Credentials"] == "true"
    assert h["Access-Control-Allow-Methods"] == ALL and h["Access-Control-Max-Age"] == "600"
    assert h["Access-Control-Allow-Headers"] == "authorization, x-foo" and h["Vary"] == PREFLIGHT_VARY
    assert h["Content-Type"] == "text/plain; charset=utf-8"

    status, h, body = call(front.base_url, "OPTIONS", "/v1/completions", preflight("http://evil.example"))
    assert (status, body) == (400, b"Disallowed CORS origin") and "Access-Control-Allow-Origin" not in h

    status, h, _ = call(front.base_url, "GET", "/v1/models", {"Origin": "http://a.example"})
    assert status == 200 and h["Access-Control-Allow-Origin"] == "http://a.example"
    assert h["Access-Control-Allow-Credentials"] == "true" and h["Vary"] == "Origin"
    # A disallowed origin: no ACAO (the credentials header is there, as Starlette sends it).
    status, h, _ = call(front.base_url, "GET", "/v1/models", {"Origin": "http://evil.example"})
    assert status == 200 and "Access-Control-Allow-Origin" not in h and h["Vary"] == "Origin"


def test_a_stream_gets_the_headers_too(front, tiny_checkpoint):
    body = {"model": str(tiny_checkpoint), "prompt": "hello", "max_tokens": 3, "stream": True}
    status, h, text = call(front.base_url, "POST", "/v1/completions", {"Origin": "http://a.example"}, body)
    assert status == 200 and h["Content-Type"] == "text/event-stream" and text.endswith(b"data: [DONE]\n\n")
    assert h["Access-Control-Allow-Origin"] == "http://a.example" and h["Vary"] == "Origin"


def test_an_error_gets_the_headers_and_a_non_preflight_options_is_405(front):
    status, h, _ = call(front.base_url, "POST", "/v1/completions", {"Origin": "http://a.example"}, {"prompt": "x", "model": "gpt-4"})
    assert status == 404 and h["Access-Control-Allow-Origin"] == "http://a.example"
    status, h, _ = call(front.base_url, "OPTIONS", "/v1/models", {"Origin": "http://a.example"})
    assert status == 405 and h["Allow"] == "GET" and h["Access-Control-Allow-Origin"] == "http://a.example"


def _answers(model: str, requests: list[tuple[str, str, dict]], **flags) -> list[tuple[int, dict, str]]:
    """The app built from ``flags`` on a free port, answering ``requests``."""

    async def run():
        server = APIServer(FrontendConfig(model, "tiny", **flags))
        out = []
        async with TestClient(TestServer(server.build_app(), port=free_port())) as client:
            for method, path, headers in requests:
                r = await client.request(method, path, headers=headers)
                out.append((r.status, dict(r.headers), await r.text()))
        return out

    return asyncio.run(run())


def test_wildcard_origins_with_a_method_and_header_list(tiny_checkpoint):
    flags = {"allowed_origins": ("*",), "allowed_methods": ("GET", "POST"), "allowed_headers": ("x-foo",)}
    z = "http://z.example"
    ok, put, put_hdr, hdr_ok, private, simple = _answers(str(tiny_checkpoint), [
        ("OPTIONS", "/v1/models", preflight(z, "POST")),
        ("OPTIONS", "/v1/models", preflight(z, "PUT")),
        ("OPTIONS", "/v1/models", preflight(z, "PUT", "X-Foo, authorization")),
        ("OPTIONS", "/v1/models", preflight(z, "GET", "X-Foo, content-type")),
        ("OPTIONS", "/v1/models", {**preflight(z, "GET"), "Access-Control-Request-Private-Network": "true"}),
        ("GET", "/v1/models", {"Origin": z}),
    ], **flags)
    assert (ok[0], ok[2]) == (200, "OK") and ok[1]["Access-Control-Allow-Origin"] == "*"
    assert ok[1]["Access-Control-Allow-Methods"] == "GET, POST"
    assert ok[1]["Access-Control-Allow-Headers"] == "Accept, Accept-Language, Content-Language, Content-Type, x-foo"
    assert "Access-Control-Allow-Credentials" not in ok[1]
    assert (put[0], put[2]) == (400, "Disallowed CORS method")
    assert (put_hdr[0], put_hdr[2]) == (400, "Disallowed CORS method, headers")
    assert (hdr_ok[0], hdr_ok[2]) == (200, "OK")
    assert (private[0], private[2]) == (400, "Disallowed CORS private-network")
    assert simple[0] == 200 and simple[1]["Access-Control-Allow-Origin"] == "*" and simple[1]["Vary"] == "Origin"


def test_wildcard_with_credentials_names_the_origin(tiny_checkpoint):
    (pre, simple) = _answers(str(tiny_checkpoint), [("OPTIONS", "/x", preflight("http://q.example")), ("GET", "/v1/models", {"Origin": "http://q.example"})],
                             allowed_origins=("*",), allow_credentials=True)
    assert pre[0] == 200 and pre[1]["Access-Control-Allow-Origin"] == "http://q.example"
    assert simple[1]["Access-Control-Allow-Origin"] == "http://q.example" and simple[1]["Access-Control-Allow-Credentials"] == "true"


def test_by_default_no_origin_is_allowed(tiny_checkpoint):
    pre, simple, plain = _answers(str(tiny_checkpoint), [("OPTIONS", "/v1/models", preflight("http://a.example", "GET")),
                                                        ("GET", "/v1/models", {"Origin": "http://a.example"}), ("GET", "/v1/models", {})])
    assert (pre[0], pre[2]) == (400, "Disallowed CORS origin")
    assert pre[1]["Access-Control-Allow-Methods"] == ALL and "Access-Control-Allow-Headers" not in pre[1]
    assert "Access-Control-Allow-Origin" not in simple[1] and simple[1]["Vary"] == "Origin"
    assert plain[0] == 200 and plain[1]["Vary"] == "Origin"
