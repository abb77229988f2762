"""What vllm-router asks a replica besides vLLM's own routes, answered by a live
`kvpool serve`: the render endpoints (the token ids the engine would run, as
/tokenize gives them), /get_model_info, /get_server_info, /get_load (the requests in
flight), /health_generate (a real one-token generation), /flush_cache (dev mode only)."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request

import pytest
from kvtest.http_api import post
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TEXT = "Blocks of sixteen tokens are hashed in a chain, each hash over its parent's."


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("probe-logs"), "--max-model-len", "512", "--dev-mode",
                      "--enable-prompt-tokens-details") as s:
        yield s


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return str(tiny_checkpoint)


def get(served, path: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(served.base_url + path, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def test_completion_render_gives_the_token_ids_tokenize_gives(served, model):
    status, tok = post(served, "/tokenize", {"model": model, "prompt": TEXT})
    assert status == 200
    status, body = post(served, "/v1/completions/render", {"model": model, "prompt": [TEXT, [5, 6, 7]], "max_tokens": 3,
                                                             "temperature": 0.5, "cache_salt": "t1", "priority": -3})
    assert status == 200, body
    assert [r["token_ids"] for r in body] == [tok["tokens"], [5, 6, 7]]
    assert len({r["request_id"] for r in body}) == 2
    for r in body:
        assert r["model"] == model and r["cache_salt"] == "t1" and r["stream"] is False and r["priority"] == -3
        assert "priority" not in r["sampling_params"]  # vLLM's GenerateRequest field, not a sampling one
        assert r["sampling_params"]["max_tokens"] == 3 and r["sampling_params"]["temperature"] == 0.5


def test_chat_render_gives_the_token_ids_tokenize_gives(served, model):
    messages = [{"role": "user", "content": TEXT}]
    status, tok = post(served, "/tokenize", {"model": model, "messages": messages})
    assert status == 200
    status, body = post(served, "/v1/chat/completions/render", {"model": model, "messages": messages, "max_tokens": 4})
    assert status == 200, body
    assert body["token_ids"] == tok["tokens"] and body["sampling_params"]["max_tokens"] == 4


def test_render_refuses_what_the_real_endpoint_refuses(served, model):
    for path in ("/v1/completions", "/v1/completions/render"):
        status, body = post(served, path, {"model": "gpt-4", "prompt": "x"})
        assert status == 404 and body["error"]["message"] == "The model `gpt-4` does not exist."
        status, body = post(served, path, {"model": model, "prompt": [5] * 600, "max_tokens": 100})
        assert status == 400 and "exceeds this limit even without any output tokens" in body["error"]["message"]
    status, body = post(served, "/v1/chat/completions/render", {"model": model, "messages": []})
    assert status == 400 and body["error"]["param"] == "messages"


def test_model_and_server_info(served, model):
    status, body = get(served, "/get_model_info")
    info = json.loads(body)
    assert status == 200 and info["model_path"] == model and info["is_generation"] is True and info["max_model_len"] == 512
    status, body = get(served, "/get_server_info")
    info = json.loads(body)
    assert status == 200 and info["served_model_name"] == model and info["ready"] is True and info["version"] == "0.1.0"
    # What vllm-router's kv_aware reads: the block size and the cache identity (vLLM's config names).
    assert info["kv_block_size"] == 16 and info["vllm_config"]["cache_config"]["block_size"] == 16
    assert info["vllm_config"]["model_config"]["model"] == model
    assert info["vllm_config"]["parallel_config"] == {"data_parallel_size": 1, "data_parallel_rank": 0}
    status, body = get(served, "/kv_event_sources")
    assert status == 200 and json.loads(body) == {}  # vLLM's answer without a publisher


def test_load_counts_the_requests_in_flight(served, model):
    assert json.loads(get(served, "/get_load")[1]) == {"load": 0}
    body = json.dumps({"model": model, "prompt": TEXT, "max_tokens": 400, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(served.base_url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as stream:
        assert stream.readline().startswith(b"data: ")  # the request is running
        assert json.loads(get(served, "/get_load")[1]) == {"load": 1}
    # NOTE: closing the stream aborts the request; the count drops once the abort is seen.
    for _ in range(100):
        if json.loads(get(served, "/get_load")[1]) == {"load": 0}:
            break
        time.sleep(0.1)
    assert json.loads(get(served, "/get_load")[1]) == {"load": 0}


def test_health_generate_runs_one_token(served):
    assert get(served, "/health_generate") == (200, b"")


def test_flush_cache_empties_the_prefix_cache_in_dev_mode(served, model):
    def cached() -> int:
        status, body = post(served, "/v1/completions", {"model": model, "prompt": TEXT * 3, "max_tokens": 1})
        assert status == 200, body
        return body["usage"]["prompt_tokens_details"]["cached_tokens"]

    cached()
    assert cached() > 0
    req = urllib.request.Request(served.base_url + "/flush_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
    assert cached() == 0


def test_flush_cache_is_refused_outside_dev_mode(tiny_checkpoint):
    from aiohttp.test_utils import TestClient, TestServer

    from frontend.api_server import APIServer
    from frontend.config import FrontendConfig

    async def run():
        server = APIServer(FrontendConfig(str(tiny_checkpoint), "tiny"))
        async with TestClient(TestServer(server.build_app())) as client:
            r = await client.post("/flush_cache")
            return r.status, await r.json()

    status, body = asyncio.run(run())
    assert status == 403 and "--dev-mode" in body["error"]["message"]
