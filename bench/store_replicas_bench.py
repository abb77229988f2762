"""Two replicas sharing a Mooncake Store against two that share nothing, behind vllm-router
(``python -m bench.store_replicas_bench``; issue #50).

Two ``kvpool serve`` of the tiny checkpoint (128-block pools) and the router workload of
bench/router_hit_rate_bench.py (12 long shared prefixes, each asked 6 times, shuffled; one,
then two requests at a time), twice each:

* ``cache_aware``, no tier: the router keeps each prefix on one replica;
* ``round_robin``, one Mooncake Store (a master and a store server on loopback): every
  replica sees every prefix, and finds in the store what the other computed.

The figure: the aggregate hit rate over both replicas, device and external hits over the
tokens looked up (their /metrics). Target: the store's round_robin at least cache_aware's.
"""

from __future__ import annotations

import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench.external_store_io import MooncakeMaster
from bench.replica_load import complete, metric_totals, shared_prefix_prompts
from bench.replicas import Replica, Router, router_binary
from bench.table import Row, print_table

NUM_BLOCKS, NUM_PREFIXES, REPEATS = 128, 12, 6
CONCURRENCIES = (1, 2)
NAMES = ("vllm:prefix_cache_hits_total", "vllm:external_prefix_cache_hits_total", "vllm:prefix_cache_queries_total")


def hit_rate(policy: str, model: Path, work: Path, store: MooncakeMaster | None, concurrency: int) -> tuple[float, int]:
    """(aggregate hit rate, failed requests) of the workload through one router over two new replicas."""
    tier = () if store is None else ("--kv-offloading-backend", "mooncake", "--mooncake-master", store.master_address,
                                     "--mooncake-metadata", store.metadata_server)
    replicas = [Replica(model, work / f"{policy}-c{concurrency}-r{i}", "--num-gpu-blocks-override", str(NUM_BLOCKS), "--max-model-len", "512",
                        "--served-model-name", "tiny", *tier) for i in range(2)]
    router = None
    try:
        for r in replicas:
            r.wait_ready()
        router = Router([r.url for r in replicas], policy, work / f"router-{policy}-c{concurrency}.log")
        router.wait_ready()
        before = [metric_totals(r.url, *NAMES) for r in replicas]
        with ThreadPoolExecutor(concurrency) as pool:
            results = list(pool.map(lambda p: complete(router.url, {"model": "tiny", "prompt": p, "max_tokens": 2}),
                                    shared_prefix_prompts(NUM_PREFIXES, REPEATS)))
        after = [metric_totals(r.url, *NAMES) for r in replicas]
    finally:
        if router is not None:
            router.stop()
        for r in replicas:
            r.stop()
    d = [sum(a[i] - b[i] for a, b in zip(after, before, strict=True)) for i in range(3)]
    return (d[0] + d[1]) / d[2] if d[2] else 0.0, sum(not ok for ok, _ in results)


def rows() -> list[Row]:
    from worker.tiny.generate import default_checkpoint

    if router_binary() is None:
        return [Row("store replicas: NOT RUN, vllm-router not found (`make install` installs it)", float("nan"), "", "", None)]
    model = default_checkpoint()
    out, failed = [], 0
    with tempfile.TemporaryDirectory(prefix="kvpool-store-replicas-") as tmp:
        work = Path(tmp)
        for c in CONCURRENCIES:
            aware, failed_aware = hit_rate("cache_aware", model, work, None, c)
            (work / f"store-c{c}").mkdir()
            with MooncakeMaster(work / f"store-c{c}") as store:
                shared, failed_shared = hit_rate("round_robin", model, work, store, c)
            failed += failed_aware + failed_shared
            out += [
                Row(f"2 replicas, {c} at a time, cache_aware, no tier: hit rate", aware, "", "", None),
                Row(f"2 replicas, {c} at a time, round_robin, one Mooncake Store: hit rate", shared, "", ">= cache_aware", shared >= aware),
            ]
    if failed:
        out.append(Row("failed requests", failed, "", "0", False))
    return out


def main() -> int:
    print_table(rows())
    return 0


if __name__ == "__main__":
    sys.exit(main())
