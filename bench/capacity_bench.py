"""Capacity of hybrid KV-cache groups (``python -m bench capacity``): how many concurrent
long requests one fixed KV pool holds with the hybrid manager (sliding-window layers'
blocks freed behind the window) against every layer kept as full attention
(``--disable-hybrid-kv-cache-manager``), beside the pattern's theoretical ratio.

The model is Gemma 3 1B's geometry: 26 layers, 5 sliding (window 512) to 1 full, one KV
head of 256 dims, bfloat16. The pool is POOL_BYTES either way: protocol.kv_cache_spec
sizes its blocks (all full: a block spans 26 layers' KV; hybrid: `num_kv_tensors`, 4).
NUM_REQUESTS requests of PROMPT_LEN random tokens (no shared prefix) and OUTPUT_LEN
output tokens arrive at once; the real Scheduler (FCFS, chunked prefill of
MAX_BATCHED tokens, vLLM's admission gate) runs them with a stand-in worker. Figures:
the most requests running at once, the most decoding at once (every prompt token
computed), preemptions, peak usage. Counts, not times: the same on any machine.

The theoretical ratio is the pattern's KV per request, every layer full over hybrid:
L * T / (F * T + S * min(W, T)) for F full and S sliding layers (the layout's padding
and the blocks a window straddles left out).
"""

from __future__ import annotations

import random

from bench.table import Row
from protocol.kv_cache_spec import kv_bytes_per_block, kv_cache_groups, num_kv_tensors
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

NUM_LAYERS, WINDOW, PATTERN = 26, 512, 6  # every 6th layer full (Gemma 3)
NUM_KV_HEADS, HEAD_DIM, ELEMENT_SIZE, BLOCK_SIZE = 1, 256, 2, 16
POOL_BYTES = 2 << 30
NUM_REQUESTS, PROMPT_LEN, OUTPUT_LEN = 64, 8192, 1024
MAX_BATCHED, MAX_MODEL_LEN = 2048, 16384


def layer_windows() -> list[int]:
    return [0 if (i + 1) % PATTERN == 0 else WINDOW for i in range(NUM_LAYERS)]


def theoretical_ratio(windows: list[int], num_tokens: int) -> float:
    full = sum(w == 0 for w in windows)
    sliding = len(windows) - full
    return len(windows) * num_tokens / (full * num_tokens + sliding * min(WINDOW, num_tokens))


def run(
    disable_hybrid: bool,
    num_requests: int = NUM_REQUESTS,
    prompt_len: int = PROMPT_LEN,
    output_len: int = OUTPUT_LEN,
) -> dict:
    """One pool of POOL_BYTES, the requests run to the end; the run's figures."""
    groups = kv_cache_groups(layer_windows(), disable_hybrid)
    block_bytes = kv_bytes_per_block(
        num_kv_tensors(groups), BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM, ELEMENT_SIZE
    )
    num_blocks = POOL_BYTES // block_bytes
    windows = [g.sliding_window for g in groups]
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, MAX_MODEL_LEN, group_windows=windows, max_num_batched_tokens=MAX_BATCHED)
    sched = Scheduler(kv, num_requests, MAX_BATCHED, MAX_MODEL_LEN)
    rng = random.Random(0)
    hasher = BlockHasher(BLOCK_SIZE)
    for i in range(num_requests):
        prompt = [rng.randrange(2, 30000) for _ in range(prompt_len)]
        sched.add_request(
            Request(f"r{i}", prompt, output_len, seq_id=i, ignore_eos=True, block_hasher=hasher)
        )
    peak_running = peak_decoding = steps = 0
    while sched.has_unfinished_requests():
        out = sched.schedule()
        steps += 1
        peak_running = max(peak_running, len(sched.running))
        peak_decoding = max(
            peak_decoding, sum(r.num_computed_tokens >= r.num_prompt_tokens for r in sched.running)
        )
        seq_ids = [r.seq_id for r in out.sampling]
        sched.update_from_output(StepResult(out.plan.step_id, seq_ids, [7] * len(seq_ids)))
    return {
        "groups": len(groups), "kv_tensors": num_kv_tensors(groups), "num_blocks": num_blocks, "peak_running": peak_running,
        "peak_decoding": peak_decoding, "preemptions": sched.num_preemptions, "peak_usage": 1 - kv.min_num_free_blocks / (num_blocks - 1),
        "steps": steps,
    }


def rows() -> list[Row]:
    full, hybrid = run(True), run(False)
    ratio = hybrid["peak_decoding"] / full["peak_decoding"]
    ideal = theoretical_ratio(layer_windows(), PROMPT_LEN + OUTPUT_LEN)
    name = f"capacity {PROMPT_LEN // 1024}k-token requests, {POOL_BYTES >> 30} GiB, Gemma-3 26 layers 5:1 W={WINDOW}"
    return [
        Row(f"{name}: all full, most decoding at once", full["peak_decoding"], "reqs"),
        Row(f"{name}: hybrid, most decoding at once", hybrid["peak_decoding"], "reqs"),
        Row(f"{name}: all full, preemptions", full["preemptions"], ""),
        Row(f"{name}: hybrid, preemptions", hybrid["preemptions"], ""),
        Row(
            f"{name}: hybrid / all full (theory {ideal:.2f}x)",
            ratio,
            "x",
            f">= {0.8 * ideal:.2f} (80 %)",
            ratio >= 0.8 * ideal,
        ),
    ]


if __name__ == "__main__":
    import json

    for disable in (True, False):
        print("all full" if disable else "hybrid", json.dumps(run(disable)))
    print(f"theory {theoretical_ratio(layer_windows(), PROMPT_LEN + OUTPUT_LEN):.2f}x")
