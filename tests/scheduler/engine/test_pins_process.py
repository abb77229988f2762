"""Pins in a live scheduler process (the API server's forwarded `PinPrefix` on the
scheduler's HTTP port): a ttl runs out on the step loop with no traffic, and a lost
worker clears the pins, in the metrics (every wait bounded; the cluster is stopped on
failure too)."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest
from kvtest.cluster import Cluster

from protocol.client_messages import Generate

pytestmark = pytest.mark.e2e

PROMPT = list(range(10, 43))  # 33 tokens: 2 full blocks of 16


def pin(cluster: Cluster, ttl_s: float | None = None) -> dict:
    body = {"prompt_token_ids": PROMPT} | ({"ttl_s": ttl_s} if ttl_s is not None else {})
    req = urllib.request.Request(f"http://127.0.0.1:{cluster.http_port}/v1/cache/pin", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        return json.loads(r.read())


def wait_metric(cluster: Cluster, name: str, value: float, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while (got := cluster.metrics().get(name)) != value:
        assert time.monotonic() < deadline, f"{name} is {got}, not {value}, after {timeout} s"
        time.sleep(0.2)


def test_a_ttl_expires_without_traffic_and_a_lost_worker_clears_the_pins():
    with Cluster(["--num-gpu-blocks-override", "20"], ["--kv-cache-memory", "1MiB", "--dtype", "float32"]) as cluster:
        assert cluster.generate([Generate("r0", PROMPT, max_tokens=1)], timeout=60)["r0"].error is None
        assert pin(cluster, ttl_s=0.5) == {"pinned_blocks": 2, "pinned_tokens": 32, "missing_blocks": 0, "block_size": 16}
        wait_metric(cluster, "kvpool_pinned_blocks", 0)
        wait_metric(cluster, "kvpool_pins_expired_total", 2)
        assert pin(cluster)["pinned_blocks"] == 2
        wait_metric(cluster, "kvpool_pinned_blocks", 2)
        cluster.procs["worker"].send_signal(signal.SIGKILL)
        wait_metric(cluster, "kvpool_pins_cleared_total", 2)
        wait_metric(cluster, "kvpool_pinned_blocks", 0)
