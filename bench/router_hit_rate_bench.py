"""Aggregate prefix-cache hit rate behind vllm-router, per policy (``python -m bench
router_hit_rate``): two ``kvpool serve`` of the tiny checkpoint (CPU), each publishing its
KV events, behind ``vllm-router --policy round_robin | cache_aware | kv_aware`` (kv_aware
subscribed to both replicas' events: bench.replicas.kv_aware_args).

The workload: NUM_PREFIXES shared prefixes of about 13 blocks, each asked REPEATS times
with its own short suffix, shuffled, CONCURRENCY clients; both replicas' prefix caches
flushed between policies. The figure is vllm:prefix_cache_hits / queries summed over
both replicas' /metrics. Each pool holds NUM_BLOCKS: all prefixes fit in the two pools
together but not twice, so a policy that caches a prefix on both replicas evicts.

The clients stream (as `vllm bench serve` and the load generator do; kv_aware's cost
counts a request as prefilling until its first streamed token, see simulator/routers.py).

Two deployments: one router, and two routers over the same replicas with the requests
alternating between them (a highly available pair behind a plain load balancer). Each
cache_aware router guesses from the half of the traffic it routed; each kv_aware router
reads the replicas' events, which say what both routed.

Targets (issue 28): kv_aware >= cache_aware > round_robin.
"""

from __future__ import annotations

import sys
import tempfile
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.replica_load import (
    aggregate_hit_rate,
    complete,
    prefix_cache_totals,
    shared_prefix_prompts,
)
from bench.replicas import Replica, Router, kv_aware_args, router_binary
from bench.table import Row

NUM_BLOCKS, BLOCK_SIZE, NUM_PREFIXES, REPEATS, CONCURRENCY = 128, 16, 12, 6, 2
POLICIES = ("round_robin", "cache_aware", "kv_aware")


def workload(seed: int = 7) -> list[str]:
    return shared_prefix_prompts(NUM_PREFIXES, REPEATS, seed)


def hit_rate(routers: list[Router], replicas: list[Replica], model: str, stream: bool) -> tuple[float, int]:
    """(aggregate hit rate, failed requests) of the workload, request i through router
    i mod len(routers)."""
    req = urllib.request.Request(routers[0].url + "/flush_cache", b"", method="POST")
    with urllib.request.urlopen(req, timeout=30) as r:
        r.read()
    before = [prefix_cache_totals(r.url) for r in replicas]

    def send(item: tuple[int, str]) -> tuple[bool, str]:
        i, prompt = item
        return complete(routers[i % len(routers)].url, {"model": model, "prompt": prompt, "max_tokens": 2, "stream": stream})

    with ThreadPoolExecutor(CONCURRENCY) as pool:
        results = list(pool.map(send, enumerate(workload())))
    after = [prefix_cache_totals(r.url) for r in replicas]
    return aggregate_hit_rate(before, after), sum(not ok for ok, _ in results)


def measure(model: str, work: Path, stream: bool = True, num_routers: int = 1) -> dict[str, tuple[float, int]]:
    replicas = [Replica(model, work / f"r{i}", "--dev-mode", "--num-gpu-blocks-override", str(NUM_BLOCKS),
                        "--max-model-len", "512", kv_events=True) for i in range(2)]
    out = {}
    try:
        for r in replicas:
            r.wait_ready()
        for policy in POLICIES:
            extra = kv_aware_args(replicas, BLOCK_SIZE, model) if policy == "kv_aware" else []
            routers: list[Router] = []
            try:
                for k in range(num_routers):
                    routers.append(Router([r.url for r in replicas], policy, work / f"router-{policy}-{k}.log", *extra))
                for router in routers:
                    router.wait_ready()
                out[policy] = hit_rate(routers, replicas, model, stream)
            finally:
                for router in routers:
                    router.stop()
    finally:
        for r in replicas:
            r.stop()
    return out


def rows() -> list[Row]:
    from worker.tiny.generate import default_checkpoint

    if router_binary() is None:
        return [Row("router hit rate: NOT RUN, vllm-router not found (`make install` installs it)", float("nan"), "", "", None)]
    out, failed = [], 0
    for num_routers in (1, 2):
        with tempfile.TemporaryDirectory(prefix="kvpool-router-hit-rate-") as tmp:
            got = measure(str(default_checkpoint()), Path(tmp), num_routers=num_routers)
        failed += sum(f for _, f in got.values())
        rate = {p: r for p, (r, _) in got.items()}
        name = (f"{'one router' if num_routers == 1 else 'two routers, requests alternating'}, 2 replicas, "
                f"shared prefixes (c{CONCURRENCY}): aggregate prefix-cache hit rate")
        out += [
            Row(f"{name}, round_robin", rate["round_robin"], "", "", None),
            Row(f"{name}, cache_aware", rate["cache_aware"], "", "> round_robin", rate["cache_aware"] > rate["round_robin"]),
            Row(f"{name}, kv_aware", rate["kv_aware"], "", ">= cache_aware", rate["kv_aware"] >= rate["cache_aware"]),
        ]
    if failed:
        print(f"router hit-rate bench: {failed} requests failed", file=sys.stderr)
    return out + [Row("router hit-rate bench: failed requests", failed, "req", "0", failed == 0)]


if __name__ == "__main__":
    from bench.table import print_table

    print_table(rows())
