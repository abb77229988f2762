"""vLLM's exact block hashes held against vLLM itself (``-m compare``): ``vllm serve`` 0.32
and ``kvpool serve`` with the same ``--prefix-caching-hash-algo`` (each of vLLM's four)
and block size publish their KV events; for the same prompts (a salted one too) the
hashes of their BlockStored events, read off the wire by a plain ZMQ SUB, are equal.

The xxhash ones run with PYTHONHASHSEED set for both (without it vLLM draws a secret
random seed, and no two processes agree); the SHA-256 ones without it (vLLM's fixed seed).
"""

from __future__ import annotations

import json
import time
import urllib.request

import msgspec
import pytest
import zmq

from bench.compare.servers import Server, ServerConfig, free_port, server_command, vllm_env

pytestmark = [pytest.mark.compare, pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(1800)]
CFG = ServerConfig(block_size=32, num_blocks=128, max_model_len=512, kv_cache_metrics=False)
NAME = "tiny"
PROMPTS = [([7, 8, 9] * 40, None), ([11] * 33 + [12] * 64, None), ([5, 6] * 50, "tenant-a")]  # 3, 3 and 3 full blocks


def stored_hashes(sub: zmq.Socket, wait_s: float) -> set:
    got: set = set()
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sub.poll(100):
            _topic, _seq, payload = sub.recv_multipart()
            for event in msgspec.msgpack.decode(payload)[1]:  # [ts, events, rank]
                if event["type"] == "BlockStored":
                    got.update(event["block_hashes"])
    return got


def complete(url: str, prompt: list[int], salt: str | None) -> None:
    body = {"model": NAME, "prompt": prompt, "max_tokens": 1, **({"cache_salt": salt} if salt else {})}
    req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200


@pytest.mark.parametrize("algo", ["sha256", "sha256_cbor", "xxhash", "xxhash_cbor"])
def test_blockstored_hashes_equal_vllms(real_vllm, tmp_path, algo):
    from bench.compare.checkpoints import checkpoint_dir

    model = checkpoint_dir("tiny")
    seed = {"PYTHONHASHSEED": "12345"} if algo.startswith("xxhash") else {}
    ctx = zmq.Context()
    servers, subs = [], []
    try:
        for engine in ("vllm", "kvpool"):
            port, pub = free_port(), free_port()
            cmd = server_command(engine, model, port, CFG, real_vllm, NAME) + ["--prefix-caching-hash-algo", algo]
            if engine == "vllm":
                env = vllm_env(tmp_path / "cache", CFG, model, 1) | seed
                cmd += ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "endpoint": f"tcp://*:{pub}"})]
            else:
                env = dict(seed)
                cmd += ["--kv-events-endpoint", f"tcp://127.0.0.1:{pub}"]
            server = Server(engine, cmd, env, tmp_path / f"{engine}.log", port)
            servers.append(server.__enter__())
            sub = ctx.socket(zmq.SUB)
            sub.setsockopt(zmq.LINGER, 0)
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(f"tcp://127.0.0.1:{pub}")
            subs.append(sub)
        for s in servers:
            s.wait_ready(600)
        time.sleep(1.0)  # NOTE: a SUB misses what is published before it has joined
        hashes = []
        for server, sub in zip(servers, subs, strict=True):
            for prompt, salt in PROMPTS:
                complete(server.url, prompt, salt)
            hashes.append(stored_hashes(sub, 3.0))
        assert len(hashes[0]) == 9, hashes[0]  # 3 distinct prompts x 3 full blocks
        assert hashes[1] == hashes[0]
    finally:
        for s in servers:
            s.stop()
        ctx.destroy(0)
