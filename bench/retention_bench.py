"""Retention: a pinned 1,024-token system prompt through a flood of unique prompts ten
times the pool, pinned and unpinned, simulated and live (``kvpool serve``, the tiny
checkpoint). ``python -m bench retention`` prints the table.

The workload: a pool of `NUM_BLOCKS` blocks of 16 tokens; `NUM_SYSTEM` requests of the
system prompt plus 16 tokens of their own, each after `FLOOD_BETWEEN` unique prompts of
512 tokens, so the unique tokens passing through are ten times the pool's. Unique
prompts cannot hit: every hit is the system prompt's, so its hit rate is the hits over
its requests' 1,024 tokens each. Pinned: pinned before the first request (live: POST
/v1/cache/pin, which computes it with a one-token request first).
"""

from __future__ import annotations

import json
import tempfile
import urllib.request
from pathlib import Path

from bench.replicas import Replica
from bench.table import Row
from loadgen.datasets import SampleRequest
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import SampleWorkload

BS, NUM_BLOCKS = 16, 201  # 200 usable: 3,200 tokens
SYSTEM_LEN, UNIQUE_LEN, NUM_SYSTEM, FLOOD_BETWEEN = 1024, 512, 10, 7  # 10 x 7 x 512 = 35,840 unique tokens: 11x the pool
VOCAB = 512


def prompts(seed: int) -> list[list[int]]:
    """The system prompt's requests, each after FLOOD_BETWEEN unique prompts (``seed``
    makes the unique ones differ between runs on one server)."""
    system = [3 + (i * 37) % (VOCAB - 3) for i in range(SYSTEM_LEN)]
    out = []
    for r in range(NUM_SYSTEM):
        for j in range(FLOOD_BETWEEN):
            k = (seed * 1000 + r * FLOOD_BETWEEN + j) % (VOCAB - 3)
            out.append([3 + k] + [3 + (k * 7 + t * 13) % (VOCAB - 3) for t in range(UNIQUE_LEN - 1)])
        out.append(system + [3 + (r * 11 + t) % (VOCAB - 3) for t in range(BS)])
    return out


def simulated(pinned: bool) -> float:
    reqs = prompts(0)
    # NOTE: the pinned run pins the first request's prefix: put the system prompt first for it.
    system = reqs[FLOOD_BETWEEN][:SYSTEM_LEN]
    w = SampleWorkload([SampleRequest(system + [5] * BS, 1)] + [SampleRequest(p, 1) for p in reqs],
                       [0.0] + [0.05 * (i + 1) for i in range(len(reqs))], VOCAB)
    cfg = SimConfig(NUM_BLOCKS, BS, max_num_seqs=1, max_num_batched_tokens=2048, pin_prefix_tokens=SYSTEM_LEN if pinned else 0,
                    max_pinned_fraction=0.5)
    r = simulate(w, cfg)
    # The leading system request is counted apart: it is the pin's own computation when unpinned.
    return (r.prefix_cache_hits - (SYSTEM_LEN if pinned else 0)) / (NUM_SYSTEM * SYSTEM_LEN)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def live() -> tuple[float, float]:
    """(unpinned, pinned) system-prompt hit rates through one live server."""
    from worker.tiny.generate import default_checkpoint

    rates = []
    with tempfile.TemporaryDirectory() as tmp:
        server = Replica(default_checkpoint(), Path(tmp), "--num-gpu-blocks-override", str(NUM_BLOCKS), "--enable-prompt-tokens-details",
                         "--max-num-seqs", "1", "--dtype", "float32")
        try:
            server.wait_ready()
            for seed, pin in ((1, False), (2, True)):
                reqs = prompts(seed)
                system = reqs[FLOOD_BETWEEN][:SYSTEM_LEN]
                if pin:
                    assert _post(server.url + "/v1/cache/pin", {"prompt_token_ids": system}) == {"pinned_blocks": 64, "pinned_tokens": 1024}
                hits = 0
                for p in reqs:
                    usage = _post(server.url + "/v1/completions", {"prompt": p, "max_tokens": 1})["usage"]
                    if p[:SYSTEM_LEN] == system:
                        hits += min(SYSTEM_LEN, usage["prompt_tokens_details"]["cached_tokens"])
                rates.append(hits / (NUM_SYSTEM * SYSTEM_LEN))
        finally:
            server.stop()
    return rates[0], rates[1]


def rows() -> list[Row]:
    sim_unpinned, sim_pinned = simulated(False), simulated(True)
    live_unpinned, live_pinned = live()
    return [
        Row("retention: pinned 1,024-token system prompt through an 11x-pool flood, hit rate, simulated", 100 * sim_pinned, "%",
            "= 100 %", sim_pinned == 1.0),
        Row("retention: the same, live kvpool serve", 100 * live_pinned, "%", "= 100 %", live_pinned == 1.0),
        Row("retention: unpinned (LRU), simulated", 100 * sim_unpinned, "%"),
        Row("retention: unpinned (LRU), live kvpool serve", 100 * live_unpinned, "%"),
    ]
