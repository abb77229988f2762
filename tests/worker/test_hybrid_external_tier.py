"""The external tier (disk backend) of a hybrid model, opened as start-up opens it
(`open_external_tier`): it moves each distinct KV tensor once, a block saved then loaded
into another block is the same bits in every distinct tensor (so in both groups' layers),
and its objects live under an identity of their own, never read by a one-group layout
of the same shapes.

Hybrid layout: 4 layers, group 0 = layers 0, 2 (window 8), group 1 = layers 1, 3 (full);
tensor 0 holds layers 0 and 1, tensor 1 layers 2 and 3. Block size 4, 2 KV heads of 8
dims, bfloat16: a tensor's block is 2 * 4 * 2 * 8 * 2 = 256 bytes, a block 512.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from protocol.external_kv import HEADER_SIZE, BadObject, decode, object_key
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import ExternalKVOps
from worker.config import WorkerConfig
from worker.external.open_tier import open_external_tier
from worker.kv.kv_cache import layer_kv_caches

BS, KVH, HD, NUM_BLOCKS = 4, 2, 8, 12
GROUPS = (KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0))
BLOCK_BYTES = 2 * (2 * BS * KVH * HD * 2)
BOUND_S = 10.0


def serving(groups) -> SimpleNamespace:
    """What the tier reads of a ServingModel: the architecture, the model's hash, the groups."""
    return SimpleNamespace(config=SimpleNamespace(architecture="TinyForCausalLM"), identity="m" * 16, kv_cache_groups=groups)


def two_tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g).to(torch.bfloat16) for _ in range(2)]


def bits(kv: torch.Tensor, b: int) -> torch.Tensor:
    return kv[:, b].contiguous().view(torch.uint8)


@pytest.fixture
def open_tier(tmp_path):
    """open_external_tier on a disk directory in tmp_path; every tier closed in teardown."""
    made = []
    config = WorkerConfig(block_size=BS, kv_offloading_backend="disk", kv_offloading_path=str(tmp_path), kv_offloading_disk_bytes=1 << 20)

    def make(groups, kv_caches):
        made.append(open_external_tier(config, serving(groups), kv_caches))
        return made[-1]

    yield make
    for io in made:
        io.close()


def run(io, ops: ExternalKVOps):
    io.submit(io.stage(ops), ops)
    assert io.drain(BOUND_S)
    return io.take_done()


def test_a_hybrid_block_saved_then_loaded_is_the_same_bits_in_every_distinct_tensor(open_tier):
    t = two_tensors(5)
    per_layer = layer_kv_caches(t, list(GROUPS))
    io = open_tier(GROUPS, per_layer)
    assert len(io.kv_caches) == 2 and io.kv_caches[0] is t[0] and io.kv_caches[1] is t[1]
    assert io.block_bytes == BLOCK_BYTES == 512
    key = object_key(io.identity, bytes(32))
    assert run(io, ExternalKVOps(save_block_ids=[3], save_keys=[key])) is None
    (f,) = io.store.dir.rglob("*.kv")
    assert f.stat().st_size == HEADER_SIZE + BLOCK_BYTES
    before = [kv.clone() for kv in t]
    assert run(io, ExternalKVOps(load_ids=[1], load_keys=[[key]], load_block_ids=[[8]])) == ({1: 1}, [])
    for kv, old in zip(t, before, strict=True):
        assert torch.equal(bits(kv, 8), bits(old, 3))
        for b in set(range(NUM_BLOCKS)) - {8}:
            assert torch.equal(bits(kv, b), bits(old, b)), f"block {b} changed"
    # Layers of both groups read block 3's KV at block 8.
    assert all(torch.equal(bits(per_layer[layer], 8), bits(before[layer // 2], 3)) for layer in range(4))


def test_a_one_group_layout_of_the_same_shapes_never_reads_the_hybrid_objects(open_tier):
    hybrid = open_tier(GROUPS, layer_kv_caches(two_tensors(5), list(GROUPS)))
    key = object_key(hybrid.identity, bytes(32))
    run(hybrid, ExternalKVOps(save_block_ids=[3], save_keys=[key]))
    (f,) = hybrid.store.dir.rglob("*.kv")
    one = open_tier((), two_tensors(6))  # 2 layers, one tensor each: the same tensors' shapes, the same block bytes
    assert one.block_bytes == hybrid.block_bytes and one.identity != hybrid.identity
    assert one.store.dir != hybrid.store.dir and one.store.keys() == []  # another directory, nothing of the hybrid's listed
    with pytest.raises(BadObject, match="foreign"):
        decode(f.read_bytes(), one.identity, key, one.block_bytes)
