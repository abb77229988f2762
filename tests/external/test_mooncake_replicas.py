"""Two `kvpool serve` replicas of the tiny checkpoint behind the real vllm-router
(``round_robin``), sharing one Mooncake Store (a real master and store server): a prefix one
replica computed is a hit on the other, loaded from the store and counted as vLLM counts a
connector's hits; the same greedy text either way. Then the whole of one replica is killed
and started again: its first request finds the prefix in the store.
"""

from __future__ import annotations

import json
import random
import time
import urllib.request

import pytest
from kvtest.router import require_router

from bench.replicas import Replica, Router, http_get

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 16
PROMPT_BLOCKS = 8


def completion(url: str, prompt: list[int]) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.load(r)


def samples(url: str) -> dict[tuple[str, str], float]:
    """(sample name, its source label or "") -> value, from a /metrics page."""
    status, text = http_get(url + "/metrics")
    assert status == 200
    out = {}
    for line in text.decode().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        source = labels.split('source="', 1)[1].split('"', 1)[0] if 'source="' in labels else ""
        out[(name, source)] = out.get((name, source), 0.0) + float(value)
    return out


def wait_saved(worker_url: str, n: int, timeout: float = 30.0) -> float:
    """Saves run off the step path: wait (bounded) until the worker saved ``n`` blocks."""
    deadline = time.monotonic() + timeout
    while (saved := samples(worker_url).get(("kvpool_kv_offload_tiering_saved_blocks_total", ""), 0.0)) < n:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return saved


def test_a_prefix_computed_by_one_replica_is_a_hit_on_the_other(tiny_checkpoint, mooncake_master, tmp_path):
    require_router()
    from kvtest.ports import free_port

    worker_ports = [free_port(), free_port()]
    store = ("--kv-offloading-backend", "mooncake", "--mooncake-master", mooncake_master.master_address,
             "--mooncake-metadata", mooncake_master.metadata_server)
    common = ("--served-model-name", "tiny", "--enable-prompt-tokens-details", "--num-gpu-blocks-override", "64", "--max-model-len", "512")

    def replica(i: int, name: str) -> Replica:
        return Replica(tiny_checkpoint, tmp_path / name, *common, *store, "--worker-http-port", str(worker_ports[i]))

    replicas = [replica(0, "r0"), replica(1, "r1")]
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = Router([r.url for r in replicas], "round_robin", tmp_path / "router.log")
        router.wait_ready()
        rng = random.Random(3)
        prompt = [rng.randrange(2, 512) for _ in range(PROMPT_BLOCKS * BLOCK + 5)]
        before = [samples(r.url) for r in replicas]
        first = completion(router.url, prompt)
        served_first = [samples(r.url)[("vllm:request_success_total", "")] - b[("vllm:request_success_total", "")]
                        for r, b in zip(replicas, before, strict=True)]
        assert sorted(served_first) == [0, 1]
        a = served_first.index(1)
        assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        assert wait_saved(f"http://127.0.0.1:{worker_ports[a]}", PROMPT_BLOCKS) >= PROMPT_BLOCKS, replicas[a].logs()

        # round_robin: the next request goes to the other replica, which never saw the prompt.
        second = completion(router.url, prompt)
        b = 1 - a
        after_b = samples(replicas[b].url)
        assert after_b[("vllm:request_success_total", "")] - before[b][("vllm:request_success_total", "")] == 1
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_BLOCKS * BLOCK, replicas[b].logs()
        assert second["choices"][0]["text"] == first["choices"][0]["text"]
        # Counted as vLLM counts a connector's hits: external, not the device's; the source is the store.
        assert after_b[("vllm:prefix_cache_hits_total", "")] - before[b][("vllm:prefix_cache_hits_total", "")] == 0
        assert after_b[("vllm:external_prefix_cache_hits_total", "")] - before[b][("vllm:external_prefix_cache_hits_total", "")] == PROMPT_BLOCKS * BLOCK
        assert after_b[("vllm:prompt_tokens_cached_by_source_total", "external_unspecified")] == PROMPT_BLOCKS * BLOCK

        # The replica that computed it, killed whole and started again: the store still has the prefix.
        replicas[a].kill()
        replicas[a].stop()  # its log closed; nothing of it runs
        replicas[a] = replica(a, "r-again")
        replicas[a].wait_ready()
        again = completion(replicas[a].url, prompt)
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == PROMPT_BLOCKS * BLOCK
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
