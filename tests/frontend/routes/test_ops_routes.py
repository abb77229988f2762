"""vLLM 0.32's operator routes as `vllm serve` answers them (each checked against one):
/version, /load with and without --enable-server-load-tracking, /ping (GET and POST
= /health), /reset_prefix_cache in dev mode (--dev-mode or VLLM_SERVER_DEV_MODE=1)
and its {"success"}, the LoRA routes behind VLLM_ALLOW_RUNTIME_LORA_UPDATING. Real
`python -m frontend` processes on a fake scheduler."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from kvtest.fake_engine import fake_engine, frontend_process


def call(front, method: str, path: str, body: dict | None = None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(front.base_url + path, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def plain(tiny_checkpoint, tmp_path_factory):
    """No flags, no dev mode; VLLM_SERVER_DEV_MODE=0 and no LoRA variable."""
    log = tmp_path_factory.mktemp("ops") / "frontend.log"
    env = {"VLLM_SERVER_DEV_MODE": "0", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "0"}
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, env=env) as f:
        f.engine = engine
        yield f


@pytest.fixture(scope="module")
def tracking(tiny_checkpoint, tmp_path_factory):
    """--enable-server-load-tracking, dev mode from VLLM_SERVER_DEV_MODE=1, runtime LoRA allowed."""
    log = tmp_path_factory.mktemp("ops-dev") / "frontend.log"
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, log, "--enable-server-load-tracking", env=env) as f:
        f.engine = engine
        yield f


def test_version_is_the_vllm_api_and_kvpools_own(plain):
    status, body = call(plain, "GET", "/version")
    assert status == 200 and json.loads(body) == {"version": "0.32.0", "kvpool_version": "0.1.0"}


def test_ping_is_health_for_get_and_post(plain):
    assert call(plain, "GET", "/ping") == (200, b"") == call(plain, "POST", "/ping") == call(plain, "GET", "/health")


def _load(front) -> int:
    status, body = call(front, "GET", "/load")
    assert status == 200
    return json.loads(body)["server_load"]


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("fixture", ["plain", "tracking"])
def test_load_counts_the_requests_being_served_only_with_tracking(request, fixture, tiny_checkpoint):
    front = request.getfixturevalue(fixture)
    body = {"model": str(tiny_checkpoint), "prompt": "hello", "max_tokens": 2}
    assert _load(front) == 0
    front.engine.holding.set()
    before = len(front.engine.generated)
    answers = []
    threads = [threading.Thread(target=lambda: answers.append(call(front, "POST", "/v1/completions", body))) for _ in range(2)]
    invocation = threading.Thread(target=lambda: answers.append(call(front, "POST", "/invocations", {**body, "prompt": "x"})))
    try:
        for t in (*threads, invocation):
            t.start()
        _wait(lambda: len(front.engine.generated) == before + 3, "the three requests reached the engine")
        assert _load(front) == (3 if fixture == "tracking" else 0)
    finally:
        front.engine.release()
        for t in (*threads, invocation):
            t.join(timeout=30)
    assert [a[0] for a in answers] == [200, 200, 200]
    assert _load(front) == 0


def test_reset_prefix_cache_is_a_dev_route(plain, tracking):
    assert call(plain, "POST", "/reset_prefix_cache")[0] == 404
    resets = tracking.engine.resets
    assert call(tracking, "POST", "/reset_prefix_cache") == (200, b'{"success":true}')
    tracking.engine.reset_status = 409  # the scheduler refuses: blocks are held
    try:
        assert call(tracking, "POST", "/reset_prefix_cache?reset_running_requests=false") == (200, b'{"success":false}')
    finally:
        tracking.engine.reset_status = 200
    assert tracking.engine.resets == resets + 2
    assert call(tracking, "GET", "/reset_prefix_cache")[0] == 405


def test_what_kvpools_scheduler_cannot_reset_is_refused_by_name(tracking):
    resets = tracking.engine.resets
    for query in ("reset_running_requests=true", "reset_external=1"):
        status, body = call(tracking, "POST", f"/reset_prefix_cache?{query}")
        error = json.loads(body)["error"]
        assert status == 501 and error["type"] == "NotImplementedError" and query.split("=")[0] in error["message"]
    status, body = call(tracking, "POST", "/reset_prefix_cache?reset_running_requests=maybe")
    assert status == 400 and json.loads(body)["error"]["param"] == "query.reset_running_requests"
    assert tracking.engine.resets == resets


def test_lora_routes_exist_only_with_runtime_lora_updating(plain, tracking):
    lora = {"lora_name": "sql", "lora_path": "/adapters/sql"}
    assert call(plain, "POST", "/v1/load_lora_adapter", lora)[0] == 404
    assert call(plain, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})[0] == 404
    status, body = call(tracking, "POST", "/v1/load_lora_adapter", lora)
    error = json.loads(body)["error"]
    assert status == 501 and "'sql'" in error["message"] and "no LoRA" in error["message"]
    status, body = call(tracking, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"})
    assert (status, json.loads(body)["error"]["message"]) == (404, "The lora adapter 'sql' cannot be found.")
    status, body = call(tracking, "POST", "/v1/load_lora_adapter", {"name": "x"})
    assert status == 400 and "lora_name" in json.loads(body)["error"]["message"]


def test_lora_requests_vllm_refuses_unread_are_400s_first(tracking, tiny_checkpoint):
    """vLLM's own checks come before kvpool's 501 (its words and type, from vLLM 0.32's serving_models)."""
    refusals = [
        ("/v1/load_lora_adapter", {"lora_name": "", "lora_path": "/adapters/sql"}, "Both 'lora_name' and 'lora_path' must be provided."),
        ("/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": ""}, "Both 'lora_name' and 'lora_path' must be provided."),
        ("/v1/load_lora_adapter", {"lora_name": str(tiny_checkpoint), "lora_path": "/a"},
         f"The lora adapter '{tiny_checkpoint}' conflicts with a served base model."),
        ("/v1/unload_lora_adapter", {"lora_name": ""}, "'lora_name' needs to be provided to unload a LoRA adapter."),
    ]
    for path, body, message in refusals:
        status, answer = call(tracking, "POST", path, body)
        error = json.loads(answer)["error"]
        assert (status, error["message"], error["type"], error["code"]) == (400, message, "InvalidUserInput", 400), body
