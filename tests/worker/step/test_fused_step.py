"""The fused step (worker/step/fused_step.py) against the layer-by-layer forward.

Two runners over the same bfloat16 model, one with the fused step and one without, are
driven by the same random plans (chunked prefills, rows left out, shared prefix blocks,
preemption and resume; tests/kvtest/mini_scheduler.py): every logit row and token must be
equal bit for bit, and the fused one must have run the steps. Models or caches it cannot
run get no fused step at all.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvtest.hf_models import VOCAB, WINDOW, make_checkpoint
from kvtest.mini_scheduler import MiniScheduler

from protocol.worker_messages import RequestRow, StepPlan
from worker.attention import paged_decode
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models import norm_act, packed_gemm
from worker.models.loader import load_model
from worker.step import fused_step
from worker.step.runner import ModelRunner

NUM_BLOCKS, BLOCK_SIZE = 256, 16

pytestmark = pytest.mark.skipif(
    None in (fused_step.load(), packed_gemm.load(), norm_act.load(), paged_decode.load()),
    reason="the fused step needs its library and the packed GEMM, norm/act and decode kernels (AVX-512 BF16)",
)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_checkpoint):
    """transformers' random checkpoints (head size 16: their chunks gather, as the prefill
    kernel takes heads of 32 and more) and the tiny default one (head size 32)."""
    kinds = ("llama", "llama-bias", "qwen2", "qwen3", "mistral-sliding")
    return {"tiny": tiny_checkpoint} | {kind: make_checkpoint(kind, tmp_path_factory.mktemp(kind)) for kind in kinds}


def runner_for(path, dtype=torch.bfloat16, kv_dtype=None, fused=True) -> ModelRunner:
    """A runner of the checkpoint; a model with a sliding window attends within it in every layer."""
    model = load_model(Checkpoint(path), dtype, "cpu")
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BLOCK_SIZE, c.num_kv_heads, c.head_dim, kv_dtype or dtype, "cpu")
    windows = [WINDOW] * c.num_layers if "sliding" in str(path) else None
    runner = ModelRunner(model, caches, 16, 256, layer_windows=windows)
    if not fused:
        runner.fused = None
    return runner


def count_fused_steps(runner: ModelRunner) -> list[tuple[int, int]]:
    """Wraps the runner's fused step; the list gets (tokens, decode rows) of each step it ran."""
    ran: list[tuple[int, int]] = []
    forward = runner.fused.forward

    def counted(token_ids, positions, metadata):
        hidden = forward(token_ids, positions, metadata)
        if hidden is not None:
            ran.append((len(token_ids), metadata.num_decode_tokens))
        return hidden

    runner.fused.forward = counted
    return ran


def drive(runner: ModelRunner, seed: int) -> MiniScheduler:
    rng = random.Random(seed)
    sched = MiniScheduler(runner, rng, NUM_BLOCKS, BLOCK_SIZE)
    for sid in range(6):
        sched.add(sid, [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(8, 30))
    sched.run()
    return sched


@pytest.mark.parametrize("kind", ["tiny", "llama", "llama-bias", "qwen2", "mistral-sliding"])
def test_fused_steps_equal_the_layer_by_layer_forward(checkpoints, kind):
    fused = runner_for(checkpoints[kind])
    assert fused.fused is not None
    ran = count_fused_steps(fused)
    a, b = drive(fused, seed=3), drive(runner_for(checkpoints[kind], fused=False), seed=3)
    assert sum(t == d > 1 for t, d in ran) >= 5  # it ran decode steps of several rows
    if kind == "tiny":  # and, where the prefill kernel runs, steps with chunks, beside decode rows among them
        assert any(t > d > 0 for t, d in ran) and any(t > d == 0 for t, d in ran)
    assert a.done.keys() == b.done.keys() and len(a.done) == 6
    for sid, req in a.done.items():
        other = b.done[sid]
        assert req.out == other.out
        assert len(req.logits) == len(other.logits)
        for (pos, la), (pos_b, lb) in zip(req.logits, other.logits, strict=True):
            assert pos == pos_b and torch.equal(la, lb), f"request {sid}, position {pos}"


def test_prefill_mixed_and_decode_steps_all_run_fused(checkpoints):
    runner = runner_for(checkpoints["tiny"])
    ran = count_fused_steps(runner)
    prompt = list(range(2, 40))
    runner.execute(StepPlan(0, {0: len(prompt)}, new_rows=[RequestRow(0, prompt, [1, 2, 3])]))
    runner.execute(StepPlan(1, {0: 1, 1: 5}, new_rows=[RequestRow(1, prompt[:5], [4])]))  # a decode row beside a chunk
    runner.execute(StepPlan(2))
    assert ran == [(len(prompt), 0), (6, 1), (2, 2)]


def test_a_step_without_the_prefill_kernel_runs_its_chunks_layer_by_layer(checkpoints):
    runner = runner_for(checkpoints["tiny"])
    runner.attention.prefill_kernel = None  # chunks through the gather and SDPA
    ran = count_fused_steps(runner)
    prompt = list(range(2, 40))
    runner.execute(StepPlan(0, {0: len(prompt)}, new_rows=[RequestRow(0, prompt, [1, 2, 3])]))
    runner.execute(StepPlan(1))
    assert ran == [(1, 1)]


@pytest.mark.parametrize(("kind", "dtype", "kv_dtype"), [
    ("qwen3", torch.bfloat16, None),  # per-head q/k norms
    ("llama", torch.float32, None),
    ("llama", torch.bfloat16, torch.float8_e4m3fn),
])
def test_models_and_caches_it_cannot_run_get_no_fused_step(checkpoints, kind, dtype, kv_dtype):
    assert runner_for(checkpoints[kind], dtype, kv_dtype).fused is None


def test_a_slot_outside_the_cache_is_refused_naming_the_layer(checkpoints):
    runner = runner_for(checkpoints["llama"])
    prompt = list(range(2, 20))
    runner.execute(StepPlan(0, {0: len(prompt)}, new_rows=[RequestRow(0, prompt, [1, 2])]))
    before = [kv.clone() for kv in runner.attention.kv_caches]
    md = runner.attention.build_metadata(runner.block_table.block_table, torch.tensor([NUM_BLOCKS * BLOCK_SIZE]), [0], [19], [])
    with pytest.raises(IndexError, match="layer 0: a block or slot outside the cache"):
        runner.fused.forward(torch.tensor([5]), torch.tensor([18]), md)
    assert all(torch.equal(a, b) for a, b in zip(before, runner.attention.kv_caches, strict=True))  # nothing written
