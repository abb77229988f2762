"""Prefill and decode on separate `kvpool serve` engines behind the real vllm-router's PD mode
(bench/pd_fleet.py): the decode engine reads the prompt's blocks from the prefill engine's
worker over its side channel, and the greedy text is one engine's. Then the faults: a
decode engine that never reads (the prefill engine frees the blocks when the lease passes),
a prefill engine killed mid-transfer (the decode engine computes the prompt itself and
loses nothing), params a client got wrong (a 400 naming the field).

The prefill engine is also the one-engine reference: a request without params is served
as by any engine. float32, tiny checkpoint, 64 blocks of 16 on each engine.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from kvtest.router import require_router

from bench.pd_fleet import PRODUCER, PDFleet, transfer_flag
from bench.replicas import Replica, http_get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

COMMON = ("--served-model-name", "tiny", "--dtype", "float32", "--num-gpu-blocks-override", "64", "--max-model-len", "512",
          "--enable-prompt-tokens-details")
LEASE_S, READ_TIMEOUT_S = 3.0, 2.0
NUM_BLOCKS = 64


def post(url: str, path: str, body: dict, timeout: float = 60.0) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def completion(url: str, prompt: list[int], max_tokens: int = 6, **extra) -> dict:
    status, answer = post(url, "/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                                                   "ignore_eos": True, "return_token_ids": True, **extra})
    assert status == 200, answer
    return answer


def metric(url: str, name: str, label: str = "") -> float:
    status, text = http_get(url + "/metrics")
    assert status == 200
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            if label in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


def wait_for(predicate, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:g} s")
        time.sleep(0.1)


def prompts(n: int, seed: int = 5) -> list[list[int]]:
    """Lengths across block edges: shorter than a block, exactly blocks, and longer."""
    rng = random.Random(seed)
    lengths = [5, 16, 17, 32, 47, 64, 100, 131]
    return [[rng.randrange(2, 500) for _ in range(lengths[i % len(lengths)] + i)] for i in range(n)]


@pytest.fixture(scope="module")
def fleet(tiny_checkpoint, tmp_path_factory):
    require_router()
    f = PDFleet(tiny_checkpoint, tmp_path_factory.mktemp("pd"), 1, 1, *COMMON,
                producer_extra={"kv_lease_duration": LEASE_S}, consumer_extra={"read_timeout": READ_TIMEOUT_S})
    try:
        yield f
    finally:
        f.stop()


def test_1p1d_behind_the_router_answers_as_one_engine(fleet):
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    batch = prompts(12)
    reference = [completion(prefill.url, p)["choices"][0]["token_ids"] for p in batch]
    p2p_before = metric(decode.url, "vllm:prompt_tokens_cached_by_source_total", 'source="p2p"')
    computed_before = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
    external_before = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"')
    through = [completion(fleet.url, p) for p in batch]
    assert [a["choices"][0]["token_ids"] for a in through] == reference
    # The decode engine read every prompt from the prefill engine, and counts it as vLLM does: the connector's
    # (its "p2p" source, and external_kv_transfer), none computed here (the last token, computed again to
    # sample from, counts as loaded, as vLLM's prefill stats count it).
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') - computed_before == 0
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="external_kv_transfer"') - external_before == sum(map(len, batch))
    assert metric(decode.url, "vllm:prompt_tokens_cached_by_source_total", 'source="p2p"') - p2p_before == sum(map(len, batch))
    # The prefill engine's blocks were read, so freed: nothing waits for the lease.
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0.0, LEASE_S / 2, "the prefill engine's blocks freed")
    # Blocks read in are the decode engine's cache now: the same prompt again is a hit there.
    hits = metric(decode.url, "vllm:prefix_cache_hits_total")
    assert completion(decode.url, batch[-1])["choices"][0]["token_ids"] == reference[-1]
    assert metric(decode.url, "vllm:prefix_cache_hits_total") - hits == (len(batch[-1]) - 1) // 16 * 16


def test_a_stream_through_the_router_is_the_same_text(fleet):
    (prefill,) = fleet.prefills
    prompt = prompts(1, seed=9)[0]
    want = completion(prefill.url, prompt, 8)["choices"][0]["text"]
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, "stream": True}
    req = urllib.request.Request(fleet.url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    text, done = "", False
    with urllib.request.urlopen(req, timeout=60) as r:
        for line in r:
            line = line.decode().strip()
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                text += json.loads(line[6:])["choices"][0]["text"]
    assert done and text == want


def test_a_decode_engine_that_never_reads_and_the_lease(fleet):
    (prefill,), (decode,) = fleet.prefills, fleet.decodes
    prompt = prompts(1, seed=11)[0]
    want = completion(prefill.url, prompt)["choices"][0]["token_ids"]
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0.0, 10, "an idle prefill engine")
    # The router's prefill leg, and nobody reads: the blocks stay lent ...
    answer = completion(prefill.url, prompt, 1, min_tokens=1, kv_transfer_params={"do_remote_decode": True})
    params = answer["kv_transfer_params"]
    # One list of block ids per KV-cache group (vLLM 0.32's): one group here.
    assert params["do_remote_prefill"] is True and [len(g) for g in params["remote_block_ids"]] == [-(-len(prompt) // 16)]
    assert metric(prefill.url, "vllm:kv_cache_usage_perc") > 0.0
    # ... until the lease passes, then they are freed.
    wait_for(lambda: metric(prefill.url, "vllm:kv_cache_usage_perc") == 0.0, LEASE_S + 5, "blocks freed after the lease")
    # A decode engine that comes late is refused, computes the prompt itself (recompute) and answers the same.
    computed = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
    late = completion(decode.url, prompt, kv_transfer_params=params)
    assert late["choices"][0]["token_ids"] == want
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') - computed == len(prompt)


def test_a_prefill_engine_killed_mid_transfer_loses_nothing(fleet, tiny_checkpoint, tmp_path):
    """The prefill engine is frozen (SIGSTOP) once it answered, so the decode worker's read
    is under way to a peer that never replies; then it is killed. The decode engine gives
    up on the read after its timeout and computes the prompt itself: the same answer."""
    (decode,) = fleet.decodes
    doomed = Replica(tiny_checkpoint, tmp_path / "doomed", *COMMON, *transfer_flag(PRODUCER))
    try:
        doomed.wait_ready()
        prompt = prompts(1, seed=13)[0]
        want = completion(doomed.url, prompt)["choices"][0]["token_ids"]
        params = completion(doomed.url, prompt, 1, kv_transfer_params={"do_remote_decode": True})["kv_transfer_params"]
        os.killpg(doomed.proc.pid, signal.SIGSTOP)
        computed = metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"')
        t0 = time.monotonic()
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(completion, decode.url, prompt, kv_transfer_params=params)
            time.sleep(0.5)  # the read is in flight
            assert not answer.done()
            doomed.kill()
            token_ids = answer.result(timeout=READ_TIMEOUT_S + 30)["choices"][0]["token_ids"]
    finally:
        doomed.stop()
    assert token_ids == want
    # It waited for the read's timeout (bounded), then computed the whole prompt.
    assert READ_TIMEOUT_S - 0.5 <= time.monotonic() - t0 < READ_TIMEOUT_S + 30
    assert metric(decode.url, "vllm:prompt_tokens_by_source_total", 'source="local_compute"') - computed == len(prompt)


@pytest.mark.parametrize("bad, field", [
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1",
      "remote_port": "abc", "remote_block_ids": [1]}, "kv_transfer_params.remote_port"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "r", "remote_host": "127.0.0.1",
      "remote_port": 9}, "kv_transfer_params.remote_block_ids"),
    ({"do_remote_decode": "yes"}, "kv_transfer_params.do_remote_decode"),
])
def test_malformed_params_are_a_400_naming_the_field(fleet, bad, field):
    (decode,) = fleet.decodes
    status, answer = post(decode.url, "/v1/completions", {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 2, "kv_transfer_params": bad})
    assert status == 400 and field in answer["error"]["message"], answer
    # Nothing else changed: the engine serves the next request.
    assert completion(decode.url, [5, 6, 7], 2)["choices"][0]["token_ids"]
