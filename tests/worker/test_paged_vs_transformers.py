"""kvpool's paged forward against transformers' forward, for every supported
architecture (and the variants: Llama 3 and linear RoPE scaling, explicit head_dim,
attention biases, tied embeddings, per-head q/k norm).

A random checkpoint is made with transformers and ``save_pretrained``; kvpool loads the
same files. A small in-test scheduler drives the runner with chunked prefills, shared
prefix blocks and preemption/resume; every logit row must be within 1e-4 (relative) of
transformers' forward over the same token ids in float32, and greedy continuations of
32 tokens must equal ``model.generate(do_sample=False)``.
"""

from __future__ import annotations

import random

import pytest
import torch
from kvtest.hf_models import (
    KINDS,
    VOCAB,
    load_reference,
    make_checkpoint,
    reference_generate,
    reference_logits,
)
from kvtest.mini_scheduler import MiniScheduler

from protocol.worker_messages import RequestRow, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

NUM_BLOCKS = 256


@pytest.fixture(scope="module", params=KINDS)
def checkpoint(request, tmp_path_factory):
    path = make_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    return path, load_reference(path)


def make_runner(path, dtype=torch.float32, block_size=16, max_num_seqs=16, max_model_len=128, **kwargs):
    model = load_model(Checkpoint(path), dtype, "cpu")
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, block_size, c.num_kv_heads, c.head_dim, dtype, "cpu")
    return model, ModelRunner(model, caches, max_num_seqs, max_model_len, **kwargs)


def drive(runner, seed: int, block_size: int, max_tokens=(1, 10)) -> MiniScheduler:
    rng = random.Random(seed)
    sched = MiniScheduler(runner, rng, NUM_BLOCKS, block_size)
    for sid in range(6):
        sched.add(sid, [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 40))], rng.randint(*max_tokens))
    for _ in range(3):
        sched.step()
    # Late arrivals, some reading prefix blocks another request wrote.
    donors = [sid for sid, r in sched.live.items() if r.computed >= block_size]
    for sid in range(6, 10):
        prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(block_size + 1, 50))]
        share = rng.choice(donors) if donors and sid % 2 == 0 else None
        sched.add(sid, prompt, rng.randint(*max_tokens), share_from=share)
    sched.run()
    assert not sched.live and not sched.preempted
    return sched


def assert_logits_close(sched: MiniScheduler, hf) -> None:
    for sid, req in sched.done.items():
        ref = reference_logits(hf, req.prompt + req.out)  # (T, V)
        for pos, logits in req.logits:
            scale = float(ref[pos].abs().max())
            torch.testing.assert_close(logits.double(), ref[pos], rtol=1e-4, atol=1e-4 * scale, msg=f"seq {sid} pos {pos}")


@pytest.mark.parametrize("block_size", [4, 16])
def test_paged_logits_match_transformers_float32(checkpoint, block_size):
    path, hf = checkpoint
    total = {"chunked": 0, "shared": 0, "preempted": 0, "resumed": 0}
    for seed in range(2):
        _, runner = make_runner(path, block_size=block_size)
        sched = drive(runner, seed, block_size)
        assert_logits_close(sched, hf)
        for k in total:
            total[k] += getattr(sched, f"num_{k}")
    assert all(v > 0 for v in total.values()), total  # the plans covered every path


def test_greedy_32_tokens_equal_generate(checkpoint):
    path, hf = checkpoint
    _, runner = make_runner(path)
    rng = random.Random(5)
    sched = MiniScheduler(runner, rng, NUM_BLOCKS, 16)
    prompts = [[rng.randrange(2, VOCAB) for _ in range(rng.randint(1, 30))] for _ in range(4)]
    for sid, prompt in enumerate(prompts):
        sched.add(sid, prompt, 32)
    sched.run()
    for sid, prompt in enumerate(prompts):
        assert sched.done[sid].out == reference_generate(hf, prompt, 32), f"seq {sid}"


def test_small_workspace_splits_decode_groups(checkpoint):
    # NOTE: a 1-byte workspace is raised to max_blocks_per_seq, so decodes of several
    # long rows split into many groups.
    path, hf = checkpoint
    _, runner = make_runner(path, block_size=4, workspace_bytes=1)
    sched = drive(runner, 7, 4)
    assert_logits_close(sched, hf)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")])])
def test_bfloat16_top_token_is_the_reference_or_a_near_tie(checkpoint, device):
    path, hf = checkpoint
    model = load_model(Checkpoint(path), torch.bfloat16, device)
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, 16, c.num_kv_heads, c.head_dim, torch.bfloat16, device)
    sched = drive(ModelRunner(model, caches, 16, 128), 0, 16)
    for req in sched.done.values():
        ref = reference_logits(hf, req.prompt + req.out)  # float32 transformers, (T, V)
        for pos, logits in req.logits:
            # NOTE: bfloat16 keeps ~3 significant digits, so the paged argmax is the
            # reference's own or within 5% of the logit range of it.
            top = int(logits.argmax())
            assert ref[pos][top] >= ref[pos].max() - 0.05 * (ref[pos].max() - ref[pos].min()), (pos, top)


def test_wide_prefill_step_matches_transformers(checkpoint):
    # Two prompts prefilled whole in one step: 620 tokens, so the MLP runs in row chunks
    # (worker.models.layers.MLP_CHUNK_ROWS) with a partial last chunk.
    path, hf = checkpoint
    _, runner = make_runner(path, max_model_len=512)
    rng = random.Random(11)
    prompts = {0: [rng.randrange(2, VOCAB) for _ in range(300)], 1: [rng.randrange(2, VOCAB) for _ in range(320)]}
    free = iter(range(1, NUM_BLOCKS))
    rows = [RequestRow(sid, p, [next(free) for _ in range(-(-len(p) // 16))], 0) for sid, p in prompts.items()]
    out = runner.execute(StepPlan(0, {sid: len(p) for sid, p in prompts.items()}, rows))
    assert out.num_scheduled_tokens == 620 and sorted(out.seq_ids) == [0, 1]
    for i, sid in enumerate(out.seq_ids):
        ref = reference_logits(hf, prompts[sid])[-1]
        torch.testing.assert_close(out.logits[i].double(), ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()), msg=f"seq {sid}")
