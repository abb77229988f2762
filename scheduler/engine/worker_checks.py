"""What the scheduler checks of a worker before trusting it.

A worker is a separate process, possibly a different build: its hello must fit
the scheduler's configuration (and, for a returning worker, the pool already
built), and its results must be tokens of the model's vocabulary.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.kv_cache_spec import is_hybrid
from protocol.worker_messages import StepResult, WorkerHello

# A pool is one Python object per block: past this the hello is not believable.
MAX_NUM_BLOCKS = 1 << 27
MAX_VOCAB_SIZE = 1 << 31
MAX_WORLD_SIZE = 1 << 10


class WorkerRefused(ValueError):
    """A worker that cannot serve this scheduler; the message says why."""


@dataclass(frozen=True, slots=True)
class PoolShape:
    """What a returning worker must match: the pool and the model it serves."""

    num_blocks: int
    vocab_size: int
    eos_token_id: int
    # The model's identity from the first hello (architecture, hash of its config and weights).
    architecture: str = ""
    model_hash: str = ""


def pool_size_for(
    hello: WorkerHello, block_size: int, num_gpu_blocks_override: int | None, current: PoolShape | None,
    max_model_len: int | None = None,
) -> int:
    """The number of blocks the pool gets with this worker, or WorkerRefused."""
    # NOTE: a tensor-parallel group talks to the scheduler through rank 0 alone, which
    # fans each plan out to its other ranks (docs/architecture.md, "Tensor parallelism").
    if hello.rank != 0 or not 1 <= hello.world_size <= MAX_WORLD_SIZE:
        raise WorkerRefused(
            f"rank {hello.rank} of world_size {hello.world_size}: only rank 0 of a tensor-parallel group (world_size "
            f"1..{MAX_WORLD_SIZE}) says hello; the other ranks get their plans from it"
        )
    if hello.block_size != block_size:
        raise WorkerRefused(f"block size {hello.block_size} differs from the scheduler's --block-size {block_size}")
    if not 2 <= hello.num_blocks <= MAX_NUM_BLOCKS:
        raise WorkerRefused(f"the worker reports {hello.num_blocks} blocks; 2..{MAX_NUM_BLOCKS} are supported")
    if not 2 <= hello.vocab_size <= MAX_VOCAB_SIZE or not 0 <= hello.eos_token_id < hello.vocab_size:
        raise WorkerRefused(f"vocabulary of {hello.vocab_size} tokens with EOS {hello.eos_token_id} is not a model's")
    if max_model_len is not None and hello.max_model_len and max_model_len > hello.max_model_len:
        raise WorkerRefused(
            f"the scheduler's --max-model-len {max_model_len} is over the {hello.max_model_len} tokens the worker's model "
            f"serves ({hello.architecture or 'its model'}); lower --max-model-len"
        )
    if current is not None:
        if (hello.architecture, hello.model_hash) != (current.architecture, current.model_hash):
            raise WorkerRefused(
                f"the worker serves another model ({hello.architecture or '?'} {hello.model_hash or '?'}) than the pool "
                f"was built for ({current.architecture or '?'} {current.model_hash or '?'})"
            )
        # NOTE: each mismatch is named alone, with both values: the operator fixes that one.
        if hello.vocab_size != current.vocab_size:
            raise WorkerRefused(
                f"vocabulary of {hello.vocab_size} tokens, but the pool was built for a model with {current.vocab_size}"
            )
        if hello.eos_token_id != current.eos_token_id:
            raise WorkerRefused(f"EOS token id {hello.eos_token_id}, but the pool was built for a model with EOS {current.eos_token_id}")
        if hello.num_blocks < current.num_blocks:
            raise WorkerRefused(
                f"the worker holds {hello.num_blocks} blocks, fewer than the pool's {current.num_blocks}: "
                "give it a larger --kv-cache-memory, or restart the scheduler to size a new pool"
            )
        return current.num_blocks
    if num_gpu_blocks_override is None:
        return hello.num_blocks
    if num_gpu_blocks_override > hello.num_blocks:
        # NOTE: a worker given the flag allocates exactly that many (as vLLM sizes its cache to it).
        raise WorkerRefused(
            f"--num-gpu-blocks-override {num_gpu_blocks_override} is more than the {hello.num_blocks} blocks the worker "
            "holds: give the worker --num-gpu-blocks-override too (kvpool serve passes it to both)"
        )
    return num_gpu_blocks_override


def check_group_windows(hello: WorkerHello, current: list[int] | None) -> list[int]:
    """The worker's KV-cache groups' windows, or WorkerRefused. ``current``: the pool's, for a
    returning worker. NOTE: the tiers serve any groups: their copies name whole block ids
    (a block's every layer), each group's block under its group-keyed hash."""
    windows = list(hello.group_windows)
    if any(w < 0 for w in windows):
        raise WorkerRefused(f"KV-cache group windows {windows}: a window is 0 (full attention) or more")
    # NOTE: [] and [0] are both one full-attention group.
    if current is not None and (windows if is_hybrid(windows) else []) != (current if is_hybrid(current) else []):
        raise WorkerRefused(f"KV-cache groups with windows {windows}, but the pool was built for {current}")
    return windows


def check_result(result: StepResult, vocab_size: int) -> None:
    """Raise ValueError if the result samples a token outside the vocabulary."""
    bad = next((t for t in result.sampled_token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ValueError(f"step {result.step_id}: the worker sampled token id {bad}, outside the vocabulary (0..{vocab_size - 1})")


def host_tier_size_for(hello: WorkerHello, kv_offloading_size: float, current: int | None) -> int:
    """The host-tier slots the scheduler manages with this worker (WorkerReady's
    num_host_blocks; 0: no tier), or WorkerRefused. ``current``: the tier already
    built for an earlier worker, None before the first."""
    if kv_offloading_size <= 0:
        return 0  # the worker frees any host memory it offered
    if hello.num_host_blocks <= 0:
        raise WorkerRefused(
            f"the scheduler runs with --kv-offloading-size {kv_offloading_size:g} GiB but the worker offers no host KV "
            "blocks: start the worker with --kv-offloading-size too (kvpool serve passes it to both)"
        )
    if hello.num_host_blocks > MAX_NUM_BLOCKS:
        raise WorkerRefused(f"the worker offers {hello.num_host_blocks} host KV blocks; at most {MAX_NUM_BLOCKS} are supported")
    if current is not None:
        if hello.num_host_blocks < current:
            raise WorkerRefused(
                f"the worker offers {hello.num_host_blocks} host KV blocks, fewer than the host tier's {current}: "
                "give it a larger --kv-offloading-size, or restart the scheduler to size a new tier"
            )
        return current
    return hello.num_host_blocks
