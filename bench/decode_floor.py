"""The real model's decode step against its floor (issue #48), everything measured in one run.

The floor of a step is the larger of what it must read over the memory's pace (the weights
once, the vocabulary's included, plus the K/V its rows attend) and its FLOPs over the bf16
GEMM rate at its row count (the bytes and FLOPs as the GPU host's floor and ``make bench``'s
model rows count them: bench/gpu/step_floor.py, bench/model_bench.py). The pace: a 1 GiB
copy, bytes read plus bytes written a second (the best of 5).
The GEMM rate: the faster of torch's bf16 ``F.linear`` and kvpool's packed kernel
(worker/models/packed_gemm.py) on two threads over one layer's four projection shapes, each
weight resident in cache (timed over repeats of the same product): a rate the step's own
products are known to reach, so the floor is one.

The step: SmolLM2-135M-Instruct in bf16 through the paged runner, rows of 256-token prompts
decoding, the fused step (worker/step/fused_step.py) and the layer-by-layer forward in
alternating rounds; each figure the median of its round's steps, the best round kept.

    python -m bench.decode_floor --rows 1,8,32
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from bench.gpu.step_floor import copy_bandwidth, kv_bytes_attended, weight_bytes
from bench.model_bench import flops_per_decode_token
from bench.real_model import smollm2_checkpoint
from protocol.worker_messages import RequestRow, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models import packed_gemm
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BLOCK_SIZE, PROMPT, STEPS = 32, 256, 16


def gemm_rate(rows: int, shapes: list[tuple[int, int]], packed: bool) -> float:
    """FLOPs a second of a bf16 product over these (out, in) weights at ``rows`` rows:
    torch's F.linear, or (packed) kvpool's packed kernel."""
    kernel = packed_gemm.load()
    total_flops, total_s = 0.0, 0.0
    for n, k in shapes:
        w, x = torch.randn(n, k).to(torch.bfloat16), torch.randn(rows, k).to(torch.bfloat16)
        if packed:
            wp = kernel.pack(w)
            product = lambda x=x, wp=wp: kernel(x, wp, None)  # noqa: E731
        else:
            product = lambda x=x, w=w: F.linear(x, w)  # noqa: E731
        for _ in range(10):
            product()
        total_s += min(_timed(lambda product=product: [product() for _ in range(50)]) for _ in range(5)) / 50
        total_flops += 2.0 * rows * n * k
    return total_flops / total_s


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def step_ms(model, rows: int, fused: bool) -> float:
    """The median decode step (ms) of ``rows`` rows with ~PROMPT tokens of context each."""
    c = model.config
    per_row = -(-(PROMPT + STEPS + 2) // BLOCK_SIZE)
    caches = allocate_kv_caches(c.num_layers, rows * per_row + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim, torch.bfloat16, "cpu")
    runner = ModelRunner(model, caches, rows, per_row * BLOCK_SIZE)
    if not fused:
        runner.fused = None
    elif runner.fused is None:
        raise SystemExit("decode_floor: the fused step does not run here (it needs AVX-512 BF16 and make install's kernels)")
    gen = torch.Generator().manual_seed(0)
    new = [RequestRow(i, torch.randint(2, c.vocab_size, (PROMPT,), generator=gen).tolist(),
                      list(range(1 + i * per_row, 1 + (i + 1) * per_row))) for i in range(rows)]
    runner.execute(StepPlan(0, {i: PROMPT for i in range(rows)}, new_rows=new))
    times = [_timed(lambda s=s: runner.execute(StepPlan(s))) for s in range(1, STEPS)]
    return 1e3 * statistics.median(times[2:])


def floor_ms(model, rows: int, bandwidth: float, rate: float) -> float:
    """The step's floor (ms): its reads over ``bandwidth`` or its FLOPs over ``rate``, the larger."""
    ctx = PROMPT + STEPS // 2  # the median step's
    reads = weight_bytes(model) + kv_bytes_attended(model, rows, ctx, model.dtype)
    flops = rows * flops_per_decode_token(model.config, ctx)
    return 1e3 * max(reads / bandwidth, flops / rate)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.decode_floor", description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="1,8,32", help="comma-separated decode batch sizes")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of fused and layer-by-layer steps")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    model = load_model(Checkpoint(smollm2_checkpoint()), torch.bfloat16, "cpu")
    layer = model.layers[0]
    shapes = [tuple(lin.dense_weight().shape) for lin in (layer.qkv, layer.o, layer.mlp.gate_up, layer.mlp.down)]
    print("| rows | copy GB/s | bf16 GEMM GFLOP/s, torch / packed | floor ms | fused step ms | layer-by-layer ms | fused / floor |"
          " layer-by-layer / floor |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in (int(r) for r in a.rows.split(",")):
        bandwidth, torch_rate, packed_rate = copy_bandwidth(torch.device("cpu"), 1 << 30, 5, min), gemm_rate(rows, shapes, False), gemm_rate(rows, shapes, True)
        rate = max(torch_rate, packed_rate)
        best = {True: float("inf"), False: float("inf")}
        for r in range(a.rounds):
            for fused in (True, False) if r % 2 == 0 else (False, True):
                best[fused] = min(best[fused], step_ms(model, rows, fused))
        floor = floor_ms(model, rows, bandwidth, rate)
        print(f"| {rows} | {bandwidth / 1e9:.1f} | {torch_rate / 1e9:.0f} / {packed_rate / 1e9:.0f} | {floor:.1f} | {best[True]:.1f} | {best[False]:.1f} | "
              f"{best[True] / floor:.2f}x | {best[False] / floor:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
