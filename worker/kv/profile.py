"""The memory peak of one serving step, measured on CUDA as vLLM's ``profile_run``: a
dummy step of ``max_num_batched_tokens`` tokens through the path serving runs (the
block table, ``PagedAttention`` with its workspace, logits for ``max_num_seqs`` rows,
a sampler pass with penalties, temperature, top-k and top-p), the allocator's peak
over what was allocated before, so the KV cache gets only what is left.

NOTE: the profile runs before the KV cache exists (it decides its size), so the step
attends through a scratch cache of just the blocks its requests fill, allocated before
the measurement starts and freed after it: not counted. Everything the runner keeps
once the cache is sized (the attention workspace, the block tables, the penalty tables,
the grammar bitmask's device copy) is built inside the measurement as the runner builds
it, so the peak counts it and the KV budget leaves room for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from protocol.sampling_params import MAX_LOGPROBS, SamplingParams
from worker.attention.kv_quant import KVScales
from worker.attention.paged_attention import DEFAULT_WORKSPACE_BYTES, PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.models.decoder import DecoderModel
from worker.sample.sampling_state import SamplingState
from worker.step.block_table import BlockTable


@dataclass(frozen=True, slots=True)
class DummyStep:
    """One step's worth of prefill: request i holds ``lengths[i]`` tokens from position 0
    in table row i, blocks ``block_ids[i]`` of a scratch cache of ``num_blocks`` blocks
    (block 0 the null block, as in the pool)."""

    max_num_seqs: int
    max_model_len: int
    block_size: int
    lengths: list[int]
    block_ids: list[list[int]]

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def num_blocks(self) -> int:
        return 1 + sum(len(ids) for ids in self.block_ids)


def dummy_step(num_tokens: int, max_num_seqs: int, max_model_len: int, block_size: int) -> DummyStep:
    """``num_tokens`` in as few requests as fit ``max_model_len`` (the widest prefill
    chunk a step can hold is one request's), at most ``max_num_seqs`` of them."""
    for name, v in (("num_tokens", num_tokens), ("max_num_seqs", max_num_seqs), ("max_model_len", max_model_len), ("block_size", block_size)):
        if v < 1:
            raise ValueError(f"dummy step: {name} must be positive, got {v}")
    num_tokens = min(num_tokens, max_num_seqs * max_model_len)
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    block_ids, next_id = [], 1
    for n in lengths:
        nb = -(-n // block_size)
        block_ids.append(list(range(next_id, next_id + nb)))
        next_id += nb
    return DummyStep(max_num_seqs, max_model_len, block_size, lengths, block_ids)


def dummy_sampling_state(max_num_seqs: int, vocab_size: int, device: torch.device) -> SamplingState:
    """Every row with vLLM's dummy sampler parameters (temperature < 1, top-k, top-p, the
    three penalties) and logprobs, so the penalty tables exist and the sort over (N, V) runs."""
    params = SamplingParams(temperature=0.5, top_p=0.9, top_k=vocab_size - 1, presence_penalty=0.1, frequency_penalty=0.1,
                            repetition_penalty=1.1, logprobs=MAX_LOGPROBS)
    state = SamplingState(max_num_seqs, vocab_size, device)
    for row in range(max_num_seqs):
        state.add(row, params, [0], 1)
    return state


@torch.inference_mode()
def run_serving_step(
    model: DecoderModel, kv_caches: list[torch.Tensor], step: DummyStep, kv_scales: list[KVScales] | None = None, num_block_tables: int = 1
) -> tuple[torch.Tensor, list[int]]:
    """Build what the runner keeps and run ``step`` through it, on any device; the
    logits (max_num_seqs, V) and the tokens sampled. ``kv_caches``: one per layer, at
    least ``step.num_blocks`` blocks. ``num_block_tables``: one per KV-cache group.
    NOTE: every layer attends in full (the widest read; a window reads less)."""
    dev, bs, n = model.device, step.block_size, step.max_num_seqs
    V = model.config.vocab_size
    max_blocks = -(-step.max_model_len // bs)
    tables = [BlockTable(n, max_blocks, bs, dev) for _ in range(num_block_tables)]
    attention = PagedAttention(kv_caches, model.num_heads, max_blocks, DEFAULT_WORKSPACE_BYTES, compute_dtype=model.dtype,
                               kv_scales=kv_scales, scale=model.config.attention_scale)
    sampling = dummy_sampling_state(n, V, dev)
    bitmask = torch.zeros((n, -(-V // 32)), dtype=torch.int32, device=dev)  # the grammar bitmask's device copy
    table = tables[0]
    for row, ids in enumerate(step.block_ids):
        table.add_row(row, ids)
    table.commit()
    rows = torch.tensor([r for r, m in enumerate(step.lengths) for _ in range(m)], dtype=torch.long, device=dev)  # (T,)
    positions = torch.cat([torch.arange(m, device=dev) for m in step.lengths])  # (T,)
    token_ids = torch.zeros(step.num_tokens, dtype=torch.long, device=dev)  # (T,)
    slots = table.compute_slot_mapping(rows, positions)  # (T,)
    md = attention.build_metadata(table.block_table, slots, [], [], [(r, 0, m) for r, m in enumerate(step.lengths)])
    hidden = model.forward(token_ids, positions, attention.for_step(md))  # (T, H)
    # NOTE: as many rows as a step may sample; random states as vLLM's dummy sampler
    # run, so no inf or nan of the dummy tokens reaches the sort.
    idx = torch.arange(n, device=dev) % step.num_tokens  # (N,)
    logits = model.compute_logits(torch.rand_like(hidden[idx]))  # (N, V)
    tokens, _ = sampling.sample(logits, list(range(n)), [0] * n)
    del bitmask  # held through the sampler pass, as the runner holds its copy
    return logits, tokens


def profile_step_peak(model: DecoderModel, step: DummyStep, kv_dtype: torch.dtype, kv_scales: list[KVScales] | None = None,
                      num_block_tables: int = 1) -> int:
    """CUDA: bytes above the current allocation that serving ``step`` needs, the buffers
    the runner keeps included (see the module's NOTE)."""
    device, c = model.device, model.config
    scratch = allocate_kv_caches(c.num_layers, step.num_blocks, step.block_size, model.num_kv_heads, c.head_dim, kv_dtype, device)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    run_serving_step(model, scratch, step, kv_scales, num_block_tables)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    del scratch
    torch.cuda.empty_cache()
    return max(0, peak)
