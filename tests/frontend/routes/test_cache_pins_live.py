"""POST /v1/cache/pin and /v1/cache/unpin through a live `kvpool serve` (one server
for the module; the fixture stops it, also on failure): a pinned prompt is still
a full hit after a flood of unique prompts several times the pool; the cap is a
400 with nothing pinned; unpin, a reset and the metrics; the API key and the
model are checked as on every /v1 route. And once with a hybrid checkpoint (Gemma 3:
sliding-window and full layers), whose pin holds the prompt in every group."""

from __future__ import annotations

import json
import shutil
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvtest.hf_models import make_checkpoint
from kvtest.http_api import metric
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

KEY = "pin-test-key"
BLOCK = 16
NUM_BLOCKS = 40  # 39 usable; the cap (default 0.5) is 19 pinned blocks
SYSTEM = [5 + (i * 7) % 200 for i in range(4 * BLOCK)]  # 4 full blocks


@pytest.fixture(scope="module")
def served(tiny_checkpoint, tmp_path_factory):
    with kvpool_serve(tiny_checkpoint, tmp_path_factory.mktemp("pins"), "--num-gpu-blocks-override", str(NUM_BLOCKS), "--api-key", KEY,
                      "--dev-mode", "--enable-prompt-tokens-details") as s:
        yield s


def call(served, path: str, body: dict | None = None, key: str | None = KEY) -> tuple[int, dict | str]:
    headers = {"Content-Type": "application/json"} | ({"Authorization": f"Bearer {key}"} if key else {})
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(served.base_url + path, data=data, headers=headers, method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read().decode()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read().decode(), e.code
    try:
        return status, json.loads(raw)
    except json.JSONDecodeError:
        return status, raw


def model(served) -> str:
    return call(served, "/v1/models")[1]["data"][0]["id"]


def cached_tokens(served, prompt: list[int]) -> int:
    status, out = call(served, "/v1/completions", {"model": model(served), "prompt": prompt, "max_tokens": 1, "ignore_eos": True})
    assert status == 200, out
    return out["usage"]["prompt_tokens_details"]["cached_tokens"]


def pinned_metric(served, name: str = "kvpool_pinned_blocks") -> float:
    return metric(call(served, "/metrics")[1], name)


def flood(served, n: int) -> None:
    # n unique prompts of 6 blocks: n * 6 blocks through the pool's unpinned ones.
    for i in range(n):
        cached_tokens(served, [300 + i] + [7 + (i * 13 + j) % 250 for j in range(6 * BLOCK - 1)])


def test_pin_survives_a_flood_unpin_does_not(served):
    status, out = call(served, "/v1/cache/pin", {"model": model(served), "prompt_token_ids": SYSTEM})
    assert status == 200 and out == {"pinned_blocks": 4, "pinned_tokens": 64}, out
    assert pinned_metric(served) == 4
    asked = SYSTEM + [9, 10, 11]
    flood(served, 12)  # 72 blocks through 35
    assert cached_tokens(served, asked) == 64
    status, out = call(served, "/v1/cache/unpin", {"model": model(served), "prompt_token_ids": SYSTEM})
    assert status == 200 and out == {"unpinned_blocks": 4, "unpinned_tokens": 64}, out
    assert pinned_metric(served) == 0
    flood(served, 12)
    assert cached_tokens(served, asked) == 0


def test_the_cap_is_a_400_and_nothing_is_pinned(served):
    long = [3 + (i * 11) % 240 for i in range(20 * BLOCK + 1)]  # 20 full blocks, over 19
    status, out = call(served, "/v1/cache/pin", {"prompt_token_ids": long, "ttl_s": 60})
    assert status == 400 and "--max-pinned-fraction" in out["error"]["message"], out
    assert pinned_metric(served) == 0 and pinned_metric(served, "kvpool_pin_refusals_total") == 1


def test_bad_requests_are_refused_by_name(served):
    assert call(served, "/v1/cache/pin", {"prompt_token_ids": SYSTEM}, key=None)[0] == 401
    status, out = call(served, "/v1/cache/pin", {"model": "other", "prompt_token_ids": SYSTEM})
    assert status == 404 and "other" in out["error"]["message"]
    for body, word in [({"prompt_token_ids": SYSTEM, "ttl_s": -1}, "ttl_s"), ({}, "prompt"), ({"prompt_token_ids": [1, 2]}, "no full KV block"),
                       ({"prompt_token_ids": SYSTEM, "pin_everything": True}, "pin_everything")]:
        status, out = call(served, "/v1/cache/pin", body)
        assert status == 400 and word in json.dumps(out), (body, out)
    assert pinned_metric(served) == 0


def test_a_text_prompt_pins_what_a_completion_of_it_hits_and_a_reset_clears_it(served):
    text = "The scheduler owns every block of KV memory as a number. " * 6
    status, out = call(served, "/v1/cache/pin", {"model": model(served), "prompt": text})
    assert status == 200 and out["pinned_blocks"] >= 2, out
    flood(served, 12)
    status, done = call(served, "/v1/completions", {"model": model(served), "prompt": text + " More", "max_tokens": 1})
    assert done["usage"]["prompt_tokens_details"]["cached_tokens"] >= out["pinned_tokens"]
    status, _ = call(served, "/reset_prefix_cache", {})
    assert status == 200
    assert pinned_metric(served) == 0 and pinned_metric(served, "kvpool_pins_cleared_total") == out["pinned_blocks"]


@pytest.fixture(scope="module")
def served_hybrid(tiny_checkpoint, tmp_path_factory):
    """A Gemma 3 checkpoint (kvtest.hf_models: sliding layers of window 16 beside full ones,
    so three KV-cache groups), with the tiny checkpoint's tokenizer."""
    d = make_checkpoint("gemma3", tmp_path_factory.mktemp("gemma3"))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(Path(tiny_checkpoint) / name, d / name)
    with kvpool_serve(d, tmp_path_factory.mktemp("hybrid-pins"), "--num-gpu-blocks-override", "60", "--api-key", KEY,
                      "--enable-prompt-tokens-details") as s:
        yield s


def flood_hybrid(served, n: int) -> None:
    # As flood, within Gemma's 256 token ids.
    for i in range(n):
        cached_tokens(served, [250 - i] + [7 + (i * 13 + j) % 240 for j in range(6 * BLOCK - 1)])


def test_a_hybrid_pin_keeps_its_hit_in_every_group_through_a_flood(served_hybrid):
    served = served_hybrid
    prompt = SYSTEM + [9]  # 4 full blocks; the sliding groups keep the block ending at token 64
    status, out = call(served, "/v1/cache/pin", {"model": model(served), "prompt_token_ids": prompt})
    assert status == 200 and out == {"pinned_blocks": 4, "pinned_tokens": 64}, out
    assert pinned_metric(served) == 4 + 1 + 1  # full attention's 4, each sliding group's tail
    asked = prompt + [10, 11]
    flood_hybrid(served, 8)  # 8 * 6 blocks in each of 3 groups through the 53 unpinned
    assert cached_tokens(served, asked) == 64
    status, out = call(served, "/v1/cache/unpin", {"model": model(served), "prompt_token_ids": prompt})
    assert status == 200 and out == {"unpinned_blocks": 4, "unpinned_tokens": 64}, out
    assert pinned_metric(served) == 0
    flood_hybrid(served, 8)
    assert cached_tokens(served, asked) == 0
