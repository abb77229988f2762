"""--api-key / VLLM_API_KEY, as vLLM 0.32's AuthenticationMiddleware (checked against a
running `vllm serve`): /v1/* (also under --root-path) needs `Authorization: Bearer`
one of the keys, else 401 `{"error":"Unauthorized"}` with no CORS headers; other
routes stay open; OPTIONS is never checked. A real `python -m frontend` on a fake
scheduler; the openai SDK as a client uses it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import openai
import pytest
from kvtest.fake_engine import fake_engine, frontend_process

from frontend.config import config_from_args
from frontend.http.auth import ApiKeys, guarded


@pytest.fixture(scope="module")
def front(tiny_checkpoint, tmp_path_factory):
    log = tmp_path_factory.mktemp("auth") / "frontend.log"
    flags = ("--api-key", "key-one", "key-two", "--root-path", "/pfx", "--allowed-origins", '["http://a.example"]')
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, *flags, env={"VLLM_API_KEY": "env-key"}) as f:
        yield f


def call(front, method: str, path: str, headers: dict | None = None, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    hdrs = {**({"Content-Type": "application/json"} if data else {}), **(headers or {})}
    req = urllib.request.Request(front.base_url + path, data=data, method=method, headers=hdrs)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


def test_the_sdk_with_a_key_is_served_and_without_one_is_refused(front, tiny_checkpoint):
    model = str(tiny_checkpoint)
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=front.base_url + "/v1", api_key=key, max_retries=0, timeout=30)
        assert client.models.list().data[0].id == model
        assert client.completions.create(model=model, prompt="hi", max_tokens=2).usage.completion_tokens == 2
    # NOTE: --api-key wins over VLLM_API_KEY, as in vLLM.
    for key in ("env-key", "key-three", "key-on"):
        bad = openai.OpenAI(base_url=front.base_url + "/v1", api_key=key, max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.status_code == 401 and e.value.body == "Unauthorized"


def test_the_401_is_vllms_body_without_cors_headers(front):
    for headers in ({}, {"Authorization": "Basic key-one"}, {"Authorization": "Bearer  key-one"}, {"Origin": "http://a.example"}):
        status, h, body = call(front, "GET", "/v1/models", headers)
        assert (status, body) == (401, b'{"error":"Unauthorized"}'), headers
        assert h["Content-Type"] == "application/json"
        assert "Access-Control-Allow-Origin" not in h and "Vary" not in h and "WWW-Authenticate" not in h
    # The scheme is case-insensitive; an unknown /v1 route is still a 401 before a 404.
    assert call(front, "GET", "/v1/models", {"Authorization": "bearer key-two"})[0] == 200
    assert call(front, "GET", "/v1/nothing-here")[0] == 401
    assert call(front, "GET", "/v1/nothing-here", {"Authorization": "Bearer key-two"})[0] == 404


def test_under_the_root_path_v1_is_guarded_too(front):
    assert call(front, "GET", "/pfx/v1/models")[0] == 401
    assert call(front, "GET", "/pfx/v1/models", {"Authorization": "Bearer key-one"})[0] == 200
    assert call(front, "GET", "/pfx/health")[0] == 200


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [("GET", "/health", None), ("GET", "/metrics", None), ("GET", "/version", None), ("GET", "/ping", None),
     ("POST", "/tokenize", {"prompt": "hello"}), ("GET", "/load", None),
     ("POST", "/invocations", {"prompt": "hello", "max_tokens": 2})],
)
def test_routes_outside_v1_need_no_key(front, method, path, body):
    assert call(front, method, path, body=body)[0] == 200


def test_a_cors_preflight_is_never_checked(front):
    status, h, body = call(front, "OPTIONS", "/v1/chat/completions", {"Origin": "http://a.example", "Access-Control-Request-Method": "POST",
                                                                       "Access-Control-Request-Headers": "authorization"})
    assert (status, body) == (200, b"OK") and h["Access-Control-Allow-Origin"] == "http://a.example"


def test_the_key_check_itself():
    keys = ApiKeys(("k1", "k2"))
    assert keys.accepts("Bearer k1") and keys.accepts("BEARER k2") and keys.accepts("bearer k1")
    for header in (None, "", "k1", "Bearer", "Bearer k3", "Bearer  k1", "Bearer k1 ", "Token k1", "Bearer k\udcff"):
        assert not keys.accepts(header), header
    assert guarded("/v1/models", None) and guarded("/v2/rerank", None) and guarded("/v1x", None)
    assert not guarded("/health", None) and not guarded("/invocations", None) and not guarded("/tokenize", None)
    assert guarded("/pfx/v1/models", "/pfx") and guarded("/v1/models", "/pfx") and not guarded("/pfx/health", "/pfx")


def test_keys_come_from_the_flag_else_vllm_api_key(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert config_from_args(["--model", "m"]).api_key == ()
    assert config_from_args(["--model", "m", "--api-key", "a", "b"]).api_key == ("a", "b")
    monkeypatch.setenv("VLLM_API_KEY", "from-env")
    assert config_from_args(["--model", "m"]).api_key == ("from-env",)
    assert config_from_args(["--model", "m", "--api-key", "a"]).api_key == ("a",)
    # As vLLM's argparse: a repeated flag keeps its last value; an empty key is none.
    assert config_from_args(["--model", "m", "--api-key", "a", "--api-key", "b"]).api_key == ("b",)
    monkeypatch.setenv("VLLM_API_KEY", "")
    assert config_from_args(["--model", "m"]).api_key == ()
