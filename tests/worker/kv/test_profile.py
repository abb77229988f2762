"""The memory profile's dummy step, on CPU (the peak itself is read from CUDA's
allocator): its requests' shape, and that it runs the serving path -- the runner's
PagedAttention writing and reading a paged cache, logits for max_num_seqs rows, a
sampler pass that builds the penalty tables."""

from __future__ import annotations

import pytest
import torch

import worker.step.runner
from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.kv.profile import dummy_sampling_state, dummy_step, run_serving_step
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model

VOCAB_SIZE = 512  # the tiny default checkpoint's


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def test_the_step_is_as_few_requests_as_fit_max_model_len():
    one = dummy_step(10, max_num_seqs=8, max_model_len=32, block_size=16)
    assert (one.lengths, one.block_ids, one.num_blocks, one.num_tokens) == ([10], [[1]], 2, 10)
    two = dummy_step(40, max_num_seqs=8, max_model_len=32, block_size=16)
    # block 0 stays the null block; each request's blocks follow the previous one's
    assert (two.lengths, two.block_ids, two.num_blocks) == ([32, 8], [[1, 2], [3]], 4)
    capped = dummy_step(1000, max_num_seqs=2, max_model_len=32, block_size=16)  # no step holds more
    assert (capped.lengths, capped.num_tokens) == ([32, 32], 64)


@pytest.mark.parametrize("name", ["num_tokens", "max_num_seqs", "max_model_len", "block_size"])
def test_a_shape_that_is_not_positive_is_named(name):
    args = {"num_tokens": 8, "max_num_seqs": 2, "max_model_len": 16, "block_size": 4, name: 0}
    with pytest.raises(ValueError, match=f"dummy step: {name} must be positive, got 0"):
        dummy_step(**args)


def test_the_sampler_pass_builds_the_penalty_tables_and_samples_every_row():
    state = dummy_sampling_state(6, VOCAB_SIZE, torch.device("cpu"))
    assert state.output_counts.shape == state.prompt_mask.shape == (6, VOCAB_SIZE)
    tokens, logprobs = state.sample(torch.randn(6, VOCAB_SIZE), list(range(6)), [0] * 6)
    assert len(tokens) == 6 and all(0 <= t < VOCAB_SIZE for t in tokens)
    assert all(lp is not None and len(lp.top_token_ids) == 20 for lp in logprobs)
    assert state.output_counts.sum().item() == 6  # each sampled token counted for the penalties


def test_the_step_runs_through_the_runners_paged_attention(model, monkeypatch):
    assert worker.step.runner.PagedAttention is PagedAttention
    calls = []
    forward = PagedAttention.forward

    def counted(self, layer, q, k, v, md):
        # the chunks as the kernel reads them, or as the gather path does
        chunks = len(md.prefill_rows.table_row) if md.prefill_rows is not None else len(md.prefills)
        calls.append((layer, q.shape[0], chunks))
        return forward(self, layer, q, k, v, md)

    monkeypatch.setattr(PagedAttention, "forward", counted)
    c = model.config
    step = dummy_step(40, max_num_seqs=5, max_model_len=32, block_size=16)
    extra = 2  # blocks past the step's: never written
    caches = allocate_kv_caches(c.num_layers, step.num_blocks + extra, 16, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    logits, tokens = run_serving_step(model, caches, step)
    # every layer, all 40 tokens as two prefill chunks
    assert calls == [(layer, 40, 2) for layer in range(c.num_layers)]
    assert logits.shape == (5, VOCAB_SIZE) and len(tokens) == 5
    for kv in caches:  # (2, num_blocks, block_size, kvh, hd)
        written = kv.abs().amax(dim=(0, 3, 4)) > 0  # (num_blocks, block_size)
        assert not written[0].any() and not written[step.num_blocks :].any()  # the null block, the blocks past the step
        assert written[1:3].all()  # request 0: 32 tokens in blocks 1, 2
        assert written[3, :8].all() and not written[3, 8:].any()  # request 1: 8 tokens in block 3
