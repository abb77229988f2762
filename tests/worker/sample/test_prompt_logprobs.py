"""Prompt logprobs in the step runner: every prompt position after the first scores
the next prompt token from the raw logits, chunk by chunk; each step hands back what
its chunks scored, and an entry for a row sampling its first token (the scheduler's cue
that the prompt is whole), never again after. Expected values come from transformers'
forward pass over the whole prompt (float64 reference), never from the runner."""

from __future__ import annotations

import pytest
import torch
from kvtest.hf_models import reference_logits

from protocol.prompt_logprobs import PromptLogprobs
from protocol.sampling_params import SamplingParams
from protocol.worker_messages import RequestRow, RowSampling, StepPlan
from worker.kv.kv_cache import allocate_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BS, NUM_BLOCKS, MAX_SEQS, MAX_LEN = 4, 32, 3, 32
PROMPT = [11, 22, 33, 44, 55, 66, 77, 88, 99]  # 9 tokens: 8 scored positions, 3 blocks


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float64, "cpu")


@pytest.fixture(scope="module")
def expected(tiny_reference):
    """Per scored position (prompt token i+1 from the logits at i): its logprob, its
    rank (tokens whose logprob is at least its own) and the top-3 ids."""
    lp = reference_logits(tiny_reference, PROMPT)[:-1].log_softmax(dim=-1)  # (8, V)
    targets = torch.tensor(PROMPT[1:])
    token_lp = lp.gather(1, targets[:, None])  # (8, 1)
    ranks = (lp >= token_lp).sum(dim=-1)
    return token_lp[:, 0].tolist(), ranks.tolist(), lp.topk(3, dim=-1).indices.tolist(), lp.topk(3, dim=-1).values.tolist()


def new_runner(model) -> ModelRunner:
    c = model.config
    caches = allocate_kv_caches(c.num_layers, NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float64, "cpu")
    return ModelRunner(model, caches, MAX_SEQS, MAX_LEN)


def row(seq_id: int, tokens: list[int], blocks: list[int], k: int | None, num_prompt: int = len(PROMPT)) -> RequestRow:
    return RequestRow(seq_id, tokens, blocks, sampling=RowSampling(num_prompt, SamplingParams(prompt_logprobs=k)))


def assert_matches(plp, expected, k: int):
    token_lp, ranks, top_ids, top_lp = expected
    assert plp.token_logprobs == pytest.approx(token_lp, abs=1e-5)
    assert plp.ranks == ranks
    assert plp.top_token_ids == [ids[:k] for ids in top_ids] if k else plp.top_token_ids == []
    if k:
        assert [v for r in plp.top_logprobs for v in r] == pytest.approx([v for r in top_lp for v in r[:k]], abs=1e-5)


def test_whole_prompt_in_one_step(model, expected):
    r = new_runner(model)
    out = r.execute(StepPlan(0, {1: 9}, new_rows=[row(1, PROMPT, [1, 2, 3], 3)]))
    assert out.seq_ids == [1] and set(out.prompt_logprobs) == {1}
    assert_matches(out.prompt_logprobs[1], expected, 3)
    # Decoding on: nothing more.
    assert not r.execute(StepPlan(1)).prompt_logprobs


def test_chunked_prefill_sends_each_chunks_positions(model, expected):
    """Chunks of 3, 1 (laid out as a decode token) and 5: 3, 1 and 4 positions scored
    (the last prompt token scores the first output token); joined, the one-shot values."""
    r = new_runner(model)
    outs = [r.execute(StepPlan(0, {1: 3}, new_rows=[row(1, PROMPT, [1, 2, 3], 2)])), r.execute(StepPlan(1, {1: 1})),
            r.execute(StepPlan(2, {1: 5}))]
    assert [len(o.prompt_logprobs[1]) for o in outs] == [3, 1, 4]
    assert [o.seq_ids for o in outs] == [[], [], [1]]
    parts = [o.prompt_logprobs[1] for o in outs]
    whole = PromptLogprobs(*([x for p in parts for x in getattr(p, f)] for f in PromptLogprobs.__struct_fields__))
    assert_matches(whole, expected, 2)
    assert not r.execute(StepPlan(3)).prompt_logprobs


def test_a_last_chunk_of_one_token_still_marks_the_prompt_whole(model):
    r = new_runner(model)
    first = r.execute(StepPlan(0, {1: 8}, new_rows=[row(1, PROMPT, [1, 2, 3], 1)]))
    last = r.execute(StepPlan(1, {1: 1}))
    assert len(first.prompt_logprobs[1]) == 8 and first.seq_ids == []
    assert last.seq_ids == [1] and len(last.prompt_logprobs[1]) == 0


def test_only_rows_that_asked(model, expected):
    """Three rows in one step: k=0 (the prompt token's own logprob and rank only),
    none asked, and k=1 on a prompt of one token (no position to score)."""
    r = new_runner(model)
    out = r.execute(StepPlan(0, {1: 9, 2: 9}, new_rows=[
        row(1, PROMPT, [1, 2, 3], 0), RequestRow(2, PROMPT, [4, 5, 6]), row(3, [5], [7], 1, num_prompt=1),
    ]))
    assert sorted(out.seq_ids) == [1, 2, 3] and set(out.prompt_logprobs) == {1, 3}
    assert_matches(out.prompt_logprobs[1], expected, 0)
    assert out.prompt_logprobs[3].token_logprobs == [] and out.prompt_logprobs[3].ranks == []


def test_preempted_mid_prefill_computes_them_afresh(model, expected):
    r = new_runner(model)
    assert len(r.execute(StepPlan(0, {1: 4}, new_rows=[row(1, PROMPT, [1, 2, 3], 3)])).prompt_logprobs[1]) == 4
    r.execute(StepPlan(1, {}, preempted_seq_ids=[1]))
    out = r.execute(StepPlan(2, {1: 9}, resumed_rows=[row(1, PROMPT, [8, 9, 10], 3)]))
    assert_matches(out.prompt_logprobs[1], expected, 3)


def test_resumed_after_its_first_token_sends_nothing_again(model):
    """A row resumed with output tokens sent its prompt logprobs with the first one:
    recomputing its prompt on resume must not send them twice (as vLLM)."""
    r = new_runner(model)
    first = r.execute(StepPlan(0, {1: 9}, new_rows=[row(1, PROMPT, [1, 2, 3], 3)]))
    second = r.execute(StepPlan(1))
    tokens = PROMPT + first.sampled_token_ids + second.sampled_token_ids
    r.execute(StepPlan(2, {}, preempted_seq_ids=[1]))
    out = r.execute(StepPlan(3, {1: len(tokens)}, resumed_rows=[row(1, tokens, [8, 9, 10], 3)]))
    assert out.seq_ids == [1] and not out.prompt_logprobs


def test_tensor_parallel_followers_skip_them(model):
    r = new_runner(model)
    r.samples = False
    out = r.execute(StepPlan(0, {1: 9}, new_rows=[row(1, PROMPT, [1, 2, 3], 3)]))
    assert not out.prompt_logprobs
