"""pool_size_for: a worker is refused when it serves another model than the pool was
built for, or a shorter context than --max-model-len."""

from __future__ import annotations

import pytest

from protocol.worker_messages import WorkerHello
from scheduler.engine.worker_checks import (
    PoolShape,
    WorkerRefused,
    host_tier_size_for,
    pool_size_for,
)


def hello(**kw) -> WorkerHello:
    base = dict(rank=0, world_size=1, num_blocks=100, block_size=16, vocab_size=512, eos_token_id=1,
                architecture="LlamaForCausalLM", model_hash="aa" * 16, eos_token_ids=[1], max_model_len=8192)
    return WorkerHello(**{**base, **kw})


POOL = PoolShape(100, 512, 1, "LlamaForCausalLM", "aa" * 16)


def test_the_same_model_comes_back():
    assert pool_size_for(hello(), 16, None, POOL, 4096) == 100


@pytest.mark.parametrize("change", [{"model_hash": "bb" * 16}, {"architecture": "Qwen3ForCausalLM"}])
def test_another_model_is_refused(change):
    with pytest.raises(WorkerRefused, match="serves another model"):
        pool_size_for(hello(**change), 16, None, POOL, 4096)


def test_a_context_shorter_than_max_model_len_is_refused():
    with pytest.raises(WorkerRefused, match="--max-model-len 16384 is over the 8192 tokens"):
        pool_size_for(hello(), 16, None, None, 16384)
    assert pool_size_for(hello(max_model_len=0), 16, None, None, 16384) == 100  # a worker that does not say


@pytest.mark.parametrize(
    "kw,words,absent",
    [
        ({"vocab_size": 513}, ["vocabulary of 513", "512"], ["blocks"]),
        ({"eos_token_id": 3}, ["EOS token id 3", "EOS 1"], ["blocks", "vocabulary"]),
        ({"num_blocks": 60}, ["60 blocks", "pool's 100", "--kv-cache-memory"], ["vocabulary", "EOS"]),
    ],
)
def test_a_returning_worker_is_told_the_exact_mismatch(kw, words, absent):
    with pytest.raises(WorkerRefused) as e:
        pool_size_for(hello(**kw), 16, None, POOL, 4096)
    for w in words:
        assert w in str(e.value), str(e.value)
    for w in absent:
        assert w not in str(e.value), str(e.value)


def test_a_first_worker_sizes_the_pool_or_the_override_does():
    assert pool_size_for(hello(num_blocks=300), 16, None, None) == 300
    assert pool_size_for(hello(num_blocks=300), 16, 200, None) == 200
    assert pool_size_for(hello(num_blocks=400), 16, 400, None) == 400  # a worker given the override holds exactly that
    # a worker started without the flag: the message says to give it the flag too
    with pytest.raises(WorkerRefused, match="more than the 300 blocks the worker holds: give the worker --num-gpu-blocks-override too"):
        pool_size_for(hello(num_blocks=300), 16, 400, None)
    with pytest.raises(WorkerRefused, match="block size 8"):
        pool_size_for(hello(block_size=8), 16, None, None)


def test_rank_0_of_a_tensor_parallel_group_is_taken():
    assert pool_size_for(hello(world_size=2), 16, None, None, 4096) == 100


@pytest.mark.parametrize("rank,world_size", [(1, 2), (0, 0), (0, 1 << 11)])
def test_another_rank_or_an_impossible_group_is_refused(rank, world_size):
    with pytest.raises(WorkerRefused, match=f"rank {rank} of world_size {world_size}: only rank 0 of a tensor-parallel group"):
        pool_size_for(hello(rank=rank, world_size=world_size), 16, None, None, 4096)


def test_the_host_tier_takes_the_slots_the_worker_offers_or_none_without_the_flag():
    assert host_tier_size_for(hello(num_host_blocks=300), 1.5, None) == 300
    # Off: the worker is told 0 and frees what it allocated.
    assert host_tier_size_for(hello(num_host_blocks=300), 0.0, None) == 0
    assert host_tier_size_for(hello(), 0.0, None) == 0
    # A returning worker keeps the tier's size if it offers at least as many.
    assert host_tier_size_for(hello(num_host_blocks=500), 1.5, 300) == 300


def test_a_worker_without_host_blocks_is_refused_when_the_scheduler_offloads():
    with pytest.raises(WorkerRefused, match=r"--kv-offloading-size 1.5 GiB but the worker offers no host KV blocks"):
        host_tier_size_for(hello(), 1.5, None)
    with pytest.raises(WorkerRefused, match="fewer than the host tier's 300"):
        host_tier_size_for(hello(num_host_blocks=200), 1.5, 300)


def test_hybrid_groups_are_accepted_and_a_returning_worker_must_bring_the_pools():
    from protocol.kv_cache_spec import is_hybrid
    from scheduler.engine.worker_checks import check_group_windows

    assert not is_hybrid([]) and not is_hybrid([0]) and is_hybrid([0, 512]) and is_hybrid([4096])
    gemma = hello(group_windows=[512] * 5 + [0])
    assert check_group_windows(gemma, None) == [512] * 5 + [0]
    # A host tier with hybrid groups is the pool's business now: the windows check says nothing of it.
    assert host_tier_size_for(hello(group_windows=[512] * 5 + [0], num_host_blocks=64), 2.0, None) == 64
    assert check_group_windows(hello(), None) == []
    # A returning worker must bring the pool's groups.
    with pytest.raises(WorkerRefused, match=r"windows \[0, 128\], but the pool was built for \[\]"):
        check_group_windows(hello(group_windows=[0, 128]), [])
    assert check_group_windows(hello(group_windows=[0]), []) == [0]  # one full group either way
    with pytest.raises(WorkerRefused, match="a window is 0"):
        check_group_windows(hello(group_windows=[0, -1]), None)
