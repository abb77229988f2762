"""Offload-tier benchmarks (``python -m bench offload``): the host tier's copies
against a plain ``copy_`` of the same bytes, and the time to first token of a prompt
whose prefix is only in the host tier against recomputing it.

* Bandwidth: 128 blocks of a 4-layer cache (float32, block size 16, 8 KV heads x 64
  dims: 64 KiB a block a layer, 32 MiB a step) stored into shuffled host slots, and
  loaded from shuffled slots into shuffled device blocks, through ``TierCopier``
  (worker/tier_copies.py), against ``copy_`` of 32 MiB between two contiguous
  buffers, in alternating rounds. Target: at least 70% of copy_'s bandwidth.
* TTFT, at the worker (the runner executing plans, as the worker process does): a
  1,024-token prompt whose first 1,008 tokens (63 blocks) are loaded from the host
  tier in the step that prefills the last 16 and samples, against the step that
  prefills all 1,024. On the tiny checkpoint (hidden 256, 4 layers) and on a
  generated larger one (hidden 1024, 8 layers, 16 heads / 8 KV heads of 64), where
  recompute costs more. Target: the host-tier TTFT below the recompute TTFT.
  NOTE: at the worker, not end to end: the scheduler process has no host tier flag
  yet; the scheduler's share of a step is the same either way.

One torch thread, as the other worker benchmarks (see bench/worker_bench.py).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from bench.table import Row
from bench.worker_bench import best_interleaved_us, warm_up
from protocol.worker_messages import RequestRow, StepPlan, TierCopies
from worker.checkpoint import Checkpoint
from worker.kv_cache import allocate_host_kv_caches, allocate_kv_caches
from worker.models.loader import load_model
from worker.runner import ModelRunner
from worker.tier_copies import TierCopier
from worker.tiny.generate import CONFIG, random_weights, write_tiny_checkpoint

BLOCK_SIZE = 16
LARGE_SHAPE = {**CONFIG, "hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16,
               "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 2816}  # fmt: skip
PROMPT_LEN, HOST_PREFIX_BLOCKS = 1024, 63


def bandwidth_rows() -> list[Row]:
    gen = torch.Generator().manual_seed(0)
    layers, num_blocks, num_host, n = 4, 1024, 512, 128
    dev = allocate_kv_caches(layers, num_blocks, BLOCK_SIZE, 8, 64, torch.float32, "cpu")
    for kv in dev:
        kv.normal_(generator=gen)
    host = allocate_host_kv_caches(dev, num_host)
    tier = TierCopier(dev, host)
    shuffled = (torch.randperm(num_blocks - 1, generator=gen) + 1).tolist()
    device_ids, load_targets = shuffled[:n], shuffled[n : 2 * n]  # disjoint, so the check below holds
    host_ids = torch.randperm(num_host, generator=gen)[:n].tolist()
    store = TierCopies(device_ids, host_ids)
    load = TierCopies(load_host_ids=host_ids, load_device_ids=load_targets)
    nbytes = n * tier.block_bytes
    src = torch.randn(nbytes // 4, generator=gen)
    dst = torch.empty_like(src)

    def plain_copy() -> None:
        dst.copy_(src)

    tier.copy(store)
    tier.copy(load)
    assert all(torch.equal(kv[:, device_ids], kv[:, load_targets]) for kv in dev)
    warm_up(plain_copy, lambda: tier.copy(store), lambda: tier.copy(load))
    copy_us, store_us = best_interleaved_us(plain_copy, lambda: tier.copy(store))
    copy_us2, load_us = best_interleaved_us(plain_copy, lambda: tier.copy(load))
    copy_gbs = nbytes / min(copy_us, copy_us2) / 1e3
    store_gbs, load_gbs = nbytes / store_us / 1e3, nbytes / load_us / 1e3
    return [
        Row("offload: copy_ of the same 32 MiB (reference)", copy_gbs, "GB/s"),
        Row("offload: store 128 blocks device -> host", store_gbs, "GB/s", "≥ 70% of copy_", store_gbs >= 0.7 * copy_gbs),
        Row("offload: load 128 blocks host -> device", load_gbs, "GB/s", "≥ 70% of copy_", load_gbs >= 0.7 * copy_gbs),
    ]


def ttft_ms(model, rounds: int = 5) -> tuple[float, float]:
    """(host-tier TTFT, recompute TTFT) in ms, best of ``rounds`` each, alternating."""
    c = model.config
    blocks = -(-PROMPT_LEN // BLOCK_SIZE)
    dev = allocate_kv_caches(c.num_layers, 2 * blocks + 1, BLOCK_SIZE, c.num_kv_heads, c.head_dim, model.dtype, "cpu")
    host = allocate_host_kv_caches(dev, HOST_PREFIX_BLOCKS)
    runner = ModelRunner(model, dev, 2, blocks * BLOCK_SIZE, host_caches=host)
    prompt = torch.randint(2, c.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(0)).tolist()
    first, second = list(range(1, blocks + 1)), list(range(blocks + 1, 2 * blocks + 1))
    # The prefix computed once and stored into the host tier.
    step = 0

    def run(plan_kwargs: dict) -> tuple[float, list[int]]:
        nonlocal step
        t0 = time.perf_counter()
        out = runner.execute(StepPlan(step, **plan_kwargs))
        elapsed = time.perf_counter() - t0
        step += 1
        return elapsed, out.sampled_token_ids

    _, recomputed = run(dict(num_scheduled_tokens={0: PROMPT_LEN}, new_rows=[RequestRow(0, prompt, first)]))
    prefix = list(range(HOST_PREFIX_BLOCKS))
    run(dict(num_scheduled_tokens={}, finished_seq_ids=[0], tier_copies=TierCopies(first[:HOST_PREFIX_BLOCKS], prefix)))
    computed = HOST_PREFIX_BLOCKS * BLOCK_SIZE
    best_host = best_recompute = float("inf")
    for i in range(rounds):
        blocks_i = second if i % 2 else first  # the other request's blocks were just freed
        tc = TierCopies(load_host_ids=prefix, load_device_ids=blocks_i[:HOST_PREFIX_BLOCKS])
        t, sampled = run(dict(num_scheduled_tokens={1: PROMPT_LEN - computed}, tier_copies=tc,
                              new_rows=[RequestRow(1, prompt, blocks_i, num_computed_tokens=computed)]))  # fmt: skip
        assert sampled == recomputed, "a prefix loaded from the host tier must sample what a recompute samples"
        best_host = min(best_host, t)
        run(dict(num_scheduled_tokens={}, finished_seq_ids=[1]))
        t, sampled = run(dict(num_scheduled_tokens={2: PROMPT_LEN}, new_rows=[RequestRow(2, prompt, blocks_i)]))
        best_recompute = min(best_recompute, t)
        run(dict(num_scheduled_tokens={}, finished_seq_ids=[2]))
    return best_host * 1e3, best_recompute * 1e3


def rows() -> list[Row]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        out = bandwidth_rows()
        with tempfile.TemporaryDirectory() as d:
            write_tiny_checkpoint(d)
            tiny = load_model(Checkpoint(d), torch.float32, "cpu")
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps(LARGE_SHAPE))
            save_file(random_weights(LARGE_SHAPE), str(Path(d) / "model.safetensors"))
            large = load_model(Checkpoint(d), torch.float32, "cpu")
        for name, model, rounds in (("tiny checkpoint", tiny, 5), ("hidden 1024 x 8 layers", large, 3)):
            host_ms, recompute_ms = ttft_ms(model, rounds)
            out += [
                Row(f"offload: TTFT 1024 tokens, recompute, {name}", recompute_ms, "ms"),
                Row(f"offload: TTFT 1024 tokens, 1008 from host, {name}", host_ms, "ms", "< recompute", host_ms < recompute_ms),
            ]
    finally:
        torch.set_num_threads(threads)
    return out
