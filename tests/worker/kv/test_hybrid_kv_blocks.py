"""A hybrid model's KV blocks as the tiers and P/D move them: by id, across the distinct KV
tensors (layers of different KV-cache groups share one, moved once). The distinct tensors
in order, a block's bytes counted and laid out by hand, gather/write round trips between
two workers' caches, and an identity that tells a hybrid layout from a one-group one of
the same shapes (the one-group identity as it always was).

Layouts used (block_size 4, 2 KV heads of 8 dims, float32: one tensor's block, K and V,
is 2 * 4 * 2 * 8 * 4 = 512 bytes):

* hybrid, 4 layers: group 0 = layers 0, 2 (window 8), group 1 = layers 1, 3 (full);
  tensor 0 holds layers 0 and 1, tensor 1 layers 2 and 3: a block is 1024 bytes;
* one group of 2 layers, one tensor each: the same shapes, also 1024 bytes a block.
"""

from __future__ import annotations

import hashlib
from types import SimpleNamespace

import pytest
import torch

from protocol.kv_cache_spec import KVCacheGroupSpec, num_kv_tensors
from worker.kv.kv_block_bytes import block_bytes, gather_blocks, kv_block_identity, write_blocks
from worker.kv.kv_cache import allocate_kv_caches, distinct_kv_tensors, layer_kv_caches

BS, KVH, HD, NUM_BLOCKS = 4, 2, 8, 12
GROUPS = [KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0)]
TENSOR_BLOCK_BYTES = 2 * BS * KVH * HD * 4  # 512


def tensors(n: int, seed: int) -> list[torch.Tensor]:
    """``n`` KV tensors (2, NUM_BLOCKS, BS, KVH, HD) of random float32."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g) for _ in range(n)]


def hybrid(seed: int) -> list[torch.Tensor]:
    """One entry per layer of the hybrid layout: [t0, t0 ... ] as layer_kv_caches shares them."""
    return layer_kv_caches(tensors(2, seed), GROUPS)


def raw(kv: torch.Tensor, b: int) -> bytes:
    return kv[:, b].contiguous().numpy().tobytes()


def test_the_distinct_tensors_are_each_shared_tensor_once_in_order():
    t = allocate_kv_caches(2, NUM_BLOCKS, BS, KVH, HD, torch.float32, "cpu")
    per_layer = layer_kv_caches(t, GROUPS)
    # Layer 0 (group 0) and layer 1 (group 1) share tensor 0; layers 2 and 3 tensor 1.
    assert [kv is t[0] for kv in per_layer] == [True, True, False, False]
    distinct = distinct_kv_tensors(per_layer)
    assert len(distinct) == num_kv_tensors(GROUPS) == 2
    assert distinct[0] is t[0] and distinct[1] is t[1]
    # Uneven groups: [0, 2, 4] full and [1, 3] windowed need 3 tensors; layer 1 shares tensor 0, layer 3 tensor 1.
    uneven = [KVCacheGroupSpec([0, 2, 4], 0), KVCacheGroupSpec([1, 3], 8)]
    t3 = allocate_kv_caches(3, NUM_BLOCKS, BS, KVH, HD, torch.float32, "cpu")
    distinct = distinct_kv_tensors(layer_kv_caches(t3, uneven))
    assert len(distinct) == num_kv_tensors(uneven) == 3 and all(d is e for d, e in zip(distinct, t3, strict=True))
    # One group of every layer: the list as it is.
    one = allocate_kv_caches(4, NUM_BLOCKS, BS, KVH, HD, torch.float32, "cpu")
    assert len(distinct_kv_tensors(one)) == 4 and all(d is e for d, e in zip(distinct_kv_tensors(one), one, strict=True))


def test_a_hybrid_block_counts_each_shared_tensor_once():
    assert block_bytes(hybrid(1)) == 2 * TENSOR_BLOCK_BYTES == 1024
    assert block_bytes(tensors(4, 1)) == 4 * TENSOR_BLOCK_BYTES


def test_gathered_bytes_are_each_distinct_tensor_k_then_v_block_major():
    per_layer = hybrid(1)
    t0, t1 = distinct_kv_tensors(per_layer)
    got = gather_blocks(per_layer, [5, 2])
    assert got.shape == (2, 1024) and got.dtype == torch.uint8
    assert got[0].numpy().tobytes() == raw(t0, 5) + raw(t1, 5)
    assert got[1].numpy().tobytes() == raw(t0, 2) + raw(t1, 2)


def test_hybrid_blocks_round_trip_between_two_workers_caches():
    # P/D: the prefill worker's blocks 3 and 5 into the decode worker's blocks 7 and 9.
    src, dst = hybrid(1), hybrid(2)
    before = [kv.clone() for kv in distinct_kv_tensors(dst)]
    write_blocks(dst, [7, 9], gather_blocks(src, [3, 5]).numpy().tobytes())
    for s, d, old in zip(distinct_kv_tensors(src), distinct_kv_tensors(dst), before, strict=True):
        assert raw(d, 7) == raw(s, 3) and raw(d, 9) == raw(s, 5)
        for b in set(range(NUM_BLOCKS)) - {7, 9}:
            assert raw(d, b) == raw(old, b), f"block {b} changed"
    # Both groups' layers see it: layer 1 (group 1) and layer 2 (group 0) read the written blocks.
    assert raw(dst[1], 7) == raw(src[1], 3) and raw(dst[2], 9) == raw(src[2], 5)
    with pytest.raises(ValueError, match="2048 bytes for 1 blocks of 1024"):
        write_blocks(dst, [7], bytes(2048))


def test_the_identity_names_the_groups_and_keeps_the_one_group_identity():
    def serving(groups):
        return SimpleNamespace(config=SimpleNamespace(architecture="TinyForCausalLM"), identity="m" * 16, kv_cache_groups=tuple(groups))

    one_group = kv_block_identity(serving(()), tensors(2, 1), BS)
    # As it was before hybrid models had tiers: the same text, the same digest.
    text = f"kvpool-kv/1|TinyForCausalLM|{'m' * 16}|float32|bs=4|L=2|kvh=2|hd=8"
    assert one_group == hashlib.sha256(text.encode()).hexdigest()[:32]
    # One explicit group of every layer is that same layout.
    assert kv_block_identity(serving([KVCacheGroupSpec([0, 1], 0)]), tensors(2, 1), BS) == one_group
    # Two tensors of the same shapes, but each shared by a layer of each group: another identity.
    hybrid_identity = kv_block_identity(serving(GROUPS), hybrid(1), BS)
    assert hybrid_identity != one_group and len(hybrid_identity) == 32
    # Other groups over the same tensors (windows swapped): another identity again.
    swapped = [KVCacheGroupSpec([0, 2], 0), KVCacheGroupSpec([1, 3], 8)]
    assert kv_block_identity(serving(swapped), layer_kv_caches(tensors(2, 1), swapped), BS) not in (hybrid_identity, one_group)
