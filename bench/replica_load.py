"""Load through replicas or a router (bench/replicas.py), and what their /metrics say:
shared-prefix prompts, one completion judged whole, a closed loop of clients, and the
prefix-cache and served-request totals of a replica."""

from __future__ import annotations

import http.client
import itertools
import json
import random
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

from bench.replicas import http_get


def shared_prefix_prompts(num_prefixes: int, repeats: int, seed: int = 7) -> list[str]:
    """The router workloads' prompts: ``num_prefixes`` long shared prefixes (100 words,
    several blocks each), each asked ``repeats`` times with its own short suffix, shuffled."""
    rng = random.Random(seed)
    words = ["block", "cache", "prefix", "hash", "token", "pool", "evict", "worker", "scheduler", "router", "replica"]
    prefixes = [" ".join(rng.choice(words) for _ in range(100)) for _ in range(num_prefixes)]
    prompts = [f"{p} {i}-{j}" for i, p in enumerate(prefixes) for j in range(repeats)]
    rng.shuffle(prompts)
    return prompts


def metric_totals(url: str, *names: str) -> tuple[float, ...]:
    """Each named sample of one replica's /metrics, summed over its labels."""
    status, text = http_get(url + "/metrics")
    if status != 200:
        raise RuntimeError(f"{url}/metrics answered {status}")
    totals = dict.fromkeys(names, 0.0)
    for line in text.decode().splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
    return tuple(totals.values())


def prefix_cache_totals(url: str) -> tuple[float, float]:
    """(hits, queries) from one replica's /metrics."""
    hits, queries = metric_totals(url, "vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total")
    return hits, queries


def aggregate_hit_rate(before: list[tuple[float, float]], after: list[tuple[float, float]]) -> float:
    """Hits over queries summed over the replicas between two `prefix_cache_totals` each;
    0.0 when nothing was looked up."""
    hits = sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    queries = sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    return hits / queries if queries else 0.0


def complete(base_url: str, body: dict, timeout: float = 60.0) -> tuple[bool, str]:
    """POST /v1/completions; (True, "") when it fully succeeded -- for a stream, when
    it ended with [DONE] -- else (False, why)."""
    req = urllib.request.Request(base_url + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            data = r.read()
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}: {e.read()[:200]!r}"
    except (OSError, http.client.HTTPException) as e:  # refused, reset, cut mid-body (IncompleteRead)
        return False, f"{type(e).__name__}: {e}"
    if body.get("stream"):
        return (True, "") if data.rstrip().endswith(b"data: [DONE]") else (False, f"stream ended without [DONE]: {data[-200:]!r}")
    try:
        ok = len(json.loads(data)["choices"]) == 1
    except (ValueError, KeyError):
        ok = False
    return (True, "") if ok else (False, f"not a completion: {data[:200]!r}")


@dataclass
class Outcome:
    start: float
    end: float
    ok: bool
    why: str


def closed_loop(base_url: str, body: dict, clients: int, stop: threading.Event) -> list[Outcome]:
    """``clients`` threads, each sending a request again as soon as its last one ended,
    until ``stop``; request n's prompt starts with n, so no two share a prefix and
    cache_aware spreads them over the replicas."""
    outcomes: list[Outcome] = []
    lock = threading.Lock()
    counter = itertools.count()

    def client():
        while not stop.is_set():
            t0 = time.monotonic()
            ok, why = complete(base_url, {**body, "prompt": f"{next(counter)}: {body['prompt']}"})
            with lock:
                outcomes.append(Outcome(t0, time.monotonic(), ok, why))

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    for t in threads:
        t.start()
    stop.wait()
    for t in threads:
        t.join(120)
    return outcomes


def requests_served(replica_url: str) -> float:
    """vllm:request_success_total summed over finish reasons (0 when unreachable)."""
    status, text = http_get(replica_url + "/metrics")
    if status != 200:
        return 0.0
    total = 0.0
    for line in text.decode().splitlines():
        if line.startswith("vllm:request_success_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total
