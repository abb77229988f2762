"""Model benchmarks (``python -m bench model``): decode throughput of the tiny default
checkpoint through the paged runner, 64 concurrent requests, against the old seeded toy
model per FLOP; and the default checkpoint's weight load time.

The toy is measured two ways: its recorded figure (the toy class is gone), and live, as
a checkpoint of the toy's exact shape through the same path, in alternating rounds with
the tiny checkpoint so a noisy spell on the shared machine hits both alike.

Decode: 64 requests with 128-token prompts are prefilled, then 32 decode steps of all
64 are timed (best of 5 rounds), one torch thread (see worker_bench for why).
FLOPs per decode token = 2 x (the matmul parameters, lm_head included) + 4 x layers x
heads x head_dim x context (QK^T and PV).

fp8 KV cache: the same decode steps in bfloat16 over an fp8 cache and a bfloat16 one, in
alternating rounds (the step time's ratio; target within 1.1x).

Shared-prefix decode: the shape of ``make compare``'s prefix workloads (block size 32,
4 prefixes of 256 tokens each shared by a quarter of the rows through the same blocks,
32-token suffixes), 64 and 8 rows, 32 decode steps (best of 3 rounds), in alternating
rounds: the default path (the in-place decode kernel, ``worker.attention.paged_decode``,
where it is built; no cascade) against the gather-and-SDPA path with the shared-prefix
(cascade) path at its threshold, the default before the kernel.
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.table import Row
from protocol.worker_messages import RequestRow, StepPlan
from worker.attention.cascade import DEFAULT_CASCADE_MIN_TOKENS
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner
from worker.tiny.generate import CONFIG, random_weights, write_tiny_checkpoint

NUM_REQUESTS, PROMPT_LEN, DECODE_STEPS, BLOCK_SIZE = 64, 128, 32, 16

# NOTE: measured with this same procedure on the old seeded toy model (hidden 128,
# 2 layers, 4 heads / 2 KV heads of 32, MLP 384, vocab 512; commit 85fe8ed's
# worker/model.py, since removed) on the 2-core development machine, quiet:
OLD_TOY_DECODE_TOKENS_PER_S = 8359.0  # best of 3 runs of 5 rounds; runs gave 6,258-8,359
OLD_TOY_GFLOPS = 8.90
TOY_SHAPE = {**CONFIG, "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 384}


def write_toy_shaped_checkpoint(d: str) -> None:
    (Path(d) / "config.json").write_text(json.dumps(TOY_SHAPE))
    save_file(random_weights(TOY_SHAPE), str(Path(d) / "model.safetensors"))


def flops_per_decode_token(c, context: int) -> float:
    H, q, kv = c.hidden_size, c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    matmul = c.num_layers * (H * (q + 2 * kv) + q * H + 3 * H * c.intermediate_size) + H * c.vocab_size
    return 2.0 * matmul + 4.0 * c.num_layers * q * context


def decode_throughput(model, rounds: int = 5, kv_dtype: torch.dtype | None = None) -> tuple[float, float]:
    """(tokens/s, GFLOP/s) of 64-request decode steps through the paged runner, over a
    KV cache of ``kv_dtype`` (None: the model's)."""
    c = model.config
    blocks_per_seq = -(-(PROMPT_LEN + DECODE_STEPS + 1) // BLOCK_SIZE)
    num_blocks = NUM_REQUESTS * blocks_per_seq + 1
    caches = allocate_kv_caches(c.num_layers, num_blocks, BLOCK_SIZE, c.num_kv_heads, c.head_dim, kv_dtype or model.dtype, "cpu")
    best = float("inf")
    gen = torch.Generator().manual_seed(0)
    for _ in range(rounds):
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


def fp8_decode_rows(model) -> list[Row]:
    """The decode steps above in bfloat16 over an fp8 KV cache against a bfloat16 one,
    in alternating rounds, best kept."""
    best = {torch.bfloat16: 0.0, torch.float8_e4m3fn: 0.0}
    for r in range(3):
        for kv in best if r % 2 == 0 else reversed(best):
            best[kv] = max(best[kv], decode_throughput(model, rounds=2, kv_dtype=kv)[0])
    ratio = best[torch.bfloat16] / best[torch.float8_e4m3fn]  # step time fp8 / bf16
    return [
        Row("model: decode, 64 requests, bf16, bf16 KV cache (1 thread)", best[torch.bfloat16], "tok/s"),
        Row("model: decode, 64 requests, bf16, fp8 KV cache", best[torch.float8_e4m3fn], "tok/s"),
        Row("model: decode step time, fp8 / bf16 KV cache", ratio, "x", "≤ 1.1×", ratio <= 1.1),
    ]


SHARED_PREFIXES, PREFIX_LEN, SUFFIX_LEN, SHARED_BLOCK_SIZE = 4, 256, 32, 32


def shared_prefix_decode(model, num_rows: int, gather: bool) -> float:
    """Decode tokens/s of ``num_rows`` rows whose first 256 tokens are one of 4 prefixes,
    held once in the pool (prefix caching's blocks), through the paged runner; gather:
    the gather-and-SDPA path with cascade at its threshold, else the default."""
    c, bs = model.config, SHARED_BLOCK_SIZE
    gen = torch.Generator().manual_seed(1)
    prefixes = [torch.randint(2, c.vocab_size, (PREFIX_LEN,), generator=gen).tolist() for _ in range(SHARED_PREFIXES)]
    prefix_blocks = PREFIX_LEN // bs
    own_blocks = -(-(PREFIX_LEN + SUFFIX_LEN + DECODE_STEPS + 1) // bs) - prefix_blocks
    num_blocks = 1 + SHARED_PREFIXES * prefix_blocks + num_rows * own_blocks
    caches = allocate_kv_caches(c.num_layers, num_blocks, bs, c.num_kv_heads, c.head_dim, model.dtype, "cpu")
    runner = ModelRunner(model, caches, num_rows, 2048)
    if gather:
        runner.attention.decode_kernel = None
        runner.attention.cascade_min_tokens = DEFAULT_CASCADE_MIN_TOKENS
    rows = []
    for i in range(num_rows):
        p = i % SHARED_PREFIXES
        shared = list(range(1 + p * prefix_blocks, 1 + (p + 1) * prefix_blocks))
        first_own = 1 + SHARED_PREFIXES * prefix_blocks + i * own_blocks
        prompt = prefixes[p] + torch.randint(2, c.vocab_size, (SUFFIX_LEN,), generator=gen).tolist()
        rows.append(RequestRow(i, prompt, shared + list(range(first_own, first_own + own_blocks))))
    # NOTE: the prefix blocks are written once per row here (same tokens, same K/V); only
    # the decode steps are timed.
    runner.execute(StepPlan(0, {i: PREFIX_LEN + SUFFIX_LEN for i in range(num_rows)}, new_rows=rows))
    t0 = time.perf_counter()
    for step in range(1, DECODE_STEPS + 1):
        runner.execute(StepPlan(step))
    return num_rows * DECODE_STEPS / (time.perf_counter() - t0)


def shared_prefix_rows(model) -> list[Row]:
    out = []
    for n in (64, 8):
        best = {"default": 0.0, "gather": 0.0}
        for r in range(3):  # NOTE: alternating rounds and which goes first, best kept
            for side in ("default", "gather") if r % 2 == 0 else ("gather", "default"):
                best[side] = max(best[side], shared_prefix_decode(model, n, gather=side == "gather"))
        ratio = best["default"] / best["gather"]
        out += [
            Row(f"model: shared-prefix decode, {n} rows, gather + SDPA, cascade where it pays (1 thread)", best["gather"], "tok/s"),
            Row(f"model: shared-prefix decode, {n} rows, default (in-place kernel)", best["default"], "tok/s"),
            Row(f"model: shared-prefix decode, {n} rows, default / gather", ratio, "x", "≥ 1.0", ratio >= 1.0),
        ]
    return out


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
            with tempfile.TemporaryDirectory() as t:
                write_toy_shaped_checkpoint(t)
                toy = load_model(Checkpoint(t), torch.float32, "cpu")
            bf16 = load_model(Checkpoint(d), torch.bfloat16, "cpu")
        tokens_per_s = gflops = toy_tps = toy_gflops = 0.0
        for _ in range(3):  # NOTE: alternating rounds, best kept
            a, b = decode_throughput(model, rounds=2)
            c, d = decode_throughput(toy, rounds=2)
            if b > gflops:
                tokens_per_s, gflops = a, b
            if d > toy_gflops:
                toy_tps, toy_gflops = c, d
        shared = shared_prefix_rows(model)
        fp8 = fp8_decode_rows(bf16)
    finally:
        torch.set_num_threads(threads)
    return [
        Row("model: tiny checkpoint, generate on first use", generate_s * 1e3, "ms", "≤ 10 s", generate_s <= 10),
        Row("model: tiny checkpoint, load weights (best of 5)", min(loads) * 1e3, "ms", "≤ 1 s", min(loads) <= 1),
        Row("model: decode, 64 requests, tiny checkpoint (1 thread)", tokens_per_s, "tok/s"),
        Row("model: decode, old toy model (recorded)", OLD_TOY_DECODE_TOKENS_PER_S, "tok/s"),
        Row("model: decode, toy-shaped checkpoint, same run", toy_tps, "tok/s"),
        Row("model: decode GFLOP/s, tiny checkpoint", gflops, "GF/s", "≥ toy's, same run", gflops >= toy_gflops),
        Row("model: decode GFLOP/s, toy-shaped checkpoint, same run", toy_gflops, "GF/s"),
        Row("model: decode GFLOP/s, old toy model (recorded)", OLD_TOY_GFLOPS, "GF/s"),
        *shared,
        *fp8,
    ]
