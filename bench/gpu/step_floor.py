"""A decode step beside its floor: ``rows`` requests of ``context`` tokens each decode one
token through the paged runner (the worker's own step: the plan applied, the forward with
paged attention, sampling); the floor is the bytes the step must read -- every weight once
and the K/V it attends -- over the copy bandwidth measured on the same device just before.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

import torch

from protocol.worker_messages import RequestRow, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import expected_shapes, load_model
from worker.step.runner import ModelRunner

BLOCK_SIZE = 16


@dataclass(frozen=True)
class StepTiming:
    rows: int
    context: int
    step_s: float  # median of the timed steps
    floor_s: float
    weight_bytes: int
    kv_bytes: int

    @property
    def over_floor(self) -> float:
        return self.step_s / self.floor_s


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 10, summary=statistics.median) -> float:
    """Bytes per second of a large copy on ``device``, counting bytes read and written
    (``summary``, the median unless given, of ``repeats`` copies' times after a warm-up)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()  # never time zeros
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return 2 * nbytes / summary(times)


def weight_bytes(model) -> int:
    """Bytes of the weights a decode step reads whole: every weight but an untied
    embedding table (of which a step reads only its rows' lines); tied, it is the LM head."""
    c = model.config
    element = torch.empty((), dtype=model.dtype).element_size()
    read = {n: s for n, s in expected_shapes(c).items() if c.tie_word_embeddings or n != "model.embed_tokens.weight"}
    return element * sum(math.prod(s) for s in read.values())


def kv_bytes_attended(model, rows: int, context: int, kv_dtype: torch.dtype) -> int:
    c = model.config
    element = torch.empty((), dtype=kv_dtype).element_size()
    return rows * context * c.num_layers * 2 * c.num_kv_heads * c.head_dim * element


def time_decode(checkpoint_dir, dtype: torch.dtype, device: torch.device, rows: int, context: int, steps: int,
                bandwidth: float, kv_dtype: torch.dtype | None = None) -> StepTiming:
    """Prefill ``rows`` random prompts of ``context - 1`` tokens, then time ``steps``
    decode steps; the median step beside its floor at ``bandwidth`` bytes/s."""
    model = load_model(Checkpoint(checkpoint_dir), dtype, device)
    c = model.config
    kv_dtype = kv_dtype or dtype
    per_row = -(-(context + steps + 1) // BLOCK_SIZE)
    caches = allocate_kv_caches(c.num_layers, rows * per_row + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim, kv_dtype, device)
    runner = ModelRunner(model, caches, rows, per_row * BLOCK_SIZE)
    gen = torch.Generator().manual_seed(rows)
    new = [RequestRow(i, torch.randint(2, c.vocab_size, (context - 1,), generator=gen).tolist(),
                      list(range(1 + i * per_row, 1 + (i + 1) * per_row))) for i in range(rows)]
    step = 0
    # NOTE: the prefill in waves of 32 rows keeps its activations small on any device;
    # the rows prefilled before a wave sit it out (0 tokens scheduled).
    for first in range(0, rows, 32):
        wave = new[first : first + 32]
        scheduled = {i: 0 for i in range(first)} | {r.seq_id: context - 1 for r in wave}
        runner.execute(StepPlan(step, scheduled, new_rows=wave))
        step += 1
    times = []
    for i in range(steps + 2):  # two warm-up steps
        synchronize(device)
        t0 = time.perf_counter()
        runner.execute(StepPlan(step))
        synchronize(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
        step += 1
    weights = weight_bytes(model)
    # NOTE: the context grows by one a step; the middle step's is the median's.
    kv = kv_bytes_attended(model, rows, context + steps // 2, kv_dtype)
    return StepTiming(rows, context, statistics.median(times), (weights + kv) / bandwidth, weights, kv)
