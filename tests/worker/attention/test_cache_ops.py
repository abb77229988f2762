"""The paged KV write: each token's K and V land in its slot, and nowhere else."""

from __future__ import annotations

import torch

from worker.attention.cache_ops import KVCacheWriter
from worker.kv.kv_cache import allocate_kv_caches


def test_the_writer_puts_each_token_into_its_slot():
    bs, kvh, hd = 4, 2, 3
    cache = allocate_kv_caches(1, 6, bs, kvh, hd, torch.float32, "cpu")[0]  # (2, 6, 4, 2, 3)
    k = torch.randn(5, kvh, hd)
    v = torch.randn(5, kvh, hd)
    slots = torch.tensor([5 * bs + 1, 2 * bs + 0, 2 * bs + 3, 1 * bs + 2, 5 * bs + 0])
    KVCacheWriter(cache).write(k, v, slots)
    for i, s in enumerate(slots.tolist()):
        assert torch.equal(cache[0, s // bs, s % bs], k[i])
        assert torch.equal(cache[1, s // bs, s % bs], v[i])
    assert int((cache != 0).sum()) == 2 * 5 * kvh * hd  # nothing else written
