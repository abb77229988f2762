"""Model benchmarks (``python -m bench model``): decode throughput of the tiny default
checkpoint through the paged runner, 64 concurrent requests, against the figure of the
old seeded toy model per FLOP; and the default checkpoint's weight load time.

Decode: 64 requests with 128-token prompts are prefilled, then 32 decode steps of all
64 are timed (best of 5 rounds), one torch thread (see worker_bench for why).
FLOPs per decode token = 2 x (the matmul parameters, lm_head included) + 4 x layers x
heads x head_dim x context (QK^T and PV).
"""

from __future__ import annotations

import tempfile
import time

import torch

from bench.table import Row
from protocol.worker_messages import RequestRow, StepPlan
from worker.checkpoint import Checkpoint
from worker.kv_cache import allocate_kv_caches
from worker.models.loader import load_model
from worker.runner import ModelRunner
from worker.tiny.generate import write_tiny_checkpoint

NUM_REQUESTS, PROMPT_LEN, DECODE_STEPS, BLOCK_SIZE = 64, 128, 32, 16

# NOTE: measured with this same procedure on the old seeded toy model (hidden 128,
# 2 layers, 4 heads / 2 KV heads of 32, MLP 384, vocab 512; commit 85fe8ed's
# worker/model.py, since removed) on the 2-core development machine, quiet:
OLD_TOY_DECODE_TOKENS_PER_S = 8359.0  # best of 3 runs of 5 rounds; runs gave 6,258-8,359
OLD_TOY_GFLOPS = 8.90


def flops_per_decode_token(c, context: int) -> float:
    H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    matmul = c.num_layers * (H * (q + 2 * kv) + q * H + 3 * H * c.intermediate_size) + H * c.vocab_size
    return 2.0 * matmul + 4.0 * c.num_layers * q * context


def decode_throughput(model) -> tuple[float, float]:
    """(tokens/s, GFLOP/s) of 64-request decode steps through the paged runner."""
    c = model.config
    blocks_per_seq = -(-(PROMPT_LEN + DECODE_STEPS + 1) // BLOCK_SIZE)
    num_blocks = NUM_REQUESTS * blocks_per_seq + 1
    caches = allocate_kv_caches(c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, model.dtype, "cpu")
    best = float("inf")
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        runner = ModelRunner(model, caches, NUM_REQUESTS, blocks_per_seq * BLOCK_SIZE)
        rows = []
        for i in range(NUM_REQUESTS):
            prompt = torch.randint(2, c.vocab_size, (PROMPT_LEN,), generator=gen).tolist()
            rows.append(RequestRow(i, prompt, list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq))))
        runner.execute(StepPlan(0, {i: PROMPT_LEN for i in range(NUM_REQUESTS)}, new_rows=rows))
        t0 = time.perf_counter()
        for step in range(1, DECODE_STEPS + 1):
            runner.execute(StepPlan(step))
        best = min(best, time.perf_counter() - t0)
    tokens_per_s = NUM_REQUESTS * DECODE_STEPS / best
    flops = flops_per_decode_token(c, PROMPT_LEN + DECODE_STEPS // 2)
    return tokens_per_s, tokens_per_s * flops / 1e9


def rows() -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            write_tiny_checkpoint(d)
            generate_s = time.perf_counter() - t0
            loads = []
            for _ in range(5):
                t0 = time.perf_counter()
                model = load_model(Checkpoint(d), torch.float32, "cpu")
                loads.append(time.perf_counter() - t0)
        tokens_per_s, gflops = decode_throughput(model)
    finally:
        torch.set_num_threads(threads)
    per_flop = gflops / OLD_TOY_GFLOPS
    return [
        Row("model: tiny checkpoint, generate on first use", generate_s * 1e3, "ms", "≤ 10 s", generate_s <= 10),
        Row("model: tiny checkpoint, load weights (best of 5)", min(loads) * 1e3, "ms", "≤ 1 s", min(loads) <= 1),
        Row("model: decode, 64 requests, tiny checkpoint (1 thread)", tokens_per_s, "tok/s"),
        Row("model: decode, old toy model (recorded)", OLD_TOY_DECODE_TOKENS_PER_S, "tok/s"),
        Row("model: decode GFLOP/s, tiny checkpoint", gflops, "GF/s", "≥ old toy's", per_flop >= 1.0),
        Row("model: decode GFLOP/s, old toy model (recorded)", OLD_TOY_GFLOPS, "GF/s"),
    ]
