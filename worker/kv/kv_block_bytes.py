"""The bytes of KV blocks, as they leave a worker and come back into one: the external
tier's object payload (worker/external/) and P/D disaggregation's pull payload
(worker/transfer/, protocol/kv_pull_wire.py).

A block's bytes are every KV tensor's K then V of that block, in the order of
``distinct_kv_tensors`` (worker/kv/kv_cache.py): one per layer, except that a hybrid
model's layers of different KV-cache groups share a tensor, moved once (block b across
them is b's whole KV, whichever group holds it); N blocks are N such runs, block-major,
in the order asked. The identity says whose bytes they are (model, KV dtype, layout and
groups, block size): a reader of another identity must not use them.

NOTE: the tensors are read and written through byte views (``view(torch.uint8)``), so
every KV dtype (fp8 included) moves the same way, bit for bit.
"""

from __future__ import annotations

import torch

from protocol.external_kv import kv_identity
from worker.kv.kv_cache import block_bytes, distinct_kv_tensors, dtype_name
from worker.load.serving_model import ServingModel


def kv_block_identity(serving: ServingModel, kv_caches: list[torch.Tensor], block_size: int) -> str:
    """The identity of this worker's KV blocks (protocol/external_kv.py), from what it holds:
    its distinct KV tensors and (a hybrid model) its KV-cache groups."""
    tensors = distinct_kv_tensors(kv_caches)
    _, _, _, kvh, hd = tensors[0].shape
    m = serving.config
    return kv_identity(m.architecture, serving.identity, dtype_name(tensors[0].dtype), block_size, len(tensors), kvh, hd,
                       serving.kv_cache_groups)


def gather_blocks(kv_caches: list[torch.Tensor], block_ids: list[int]) -> torch.Tensor:
    """The bytes of blocks ``block_ids``, block-major, in host memory: (n, block_bytes) uint8."""
    kv_caches = distinct_kv_tensors(kv_caches)
    index = torch.tensor(block_ids, dtype=torch.long, device=kv_caches[0].device)
    # Each (2, n, bs, kvh, hd * itemsize); stacked (tensors, 2, n, ...) -> (n, tensors, 2, ...): a block's bytes contiguous.
    per_tensor = [_bytes_view(kv).index_select(1, index) for kv in kv_caches]
    gathered = torch.stack(per_tensor).permute(2, 0, 1, 3, 4, 5)
    return gathered.contiguous().cpu().reshape(len(block_ids), -1)


def write_blocks(kv_caches: list[torch.Tensor], block_ids: list[int], payload) -> None:
    """Write ``payload`` (a buffer of ``len(block_ids) * block_bytes`` bytes, as `gather_blocks`
    makes) into blocks ``block_ids``, in order. ValueError when its length differs."""
    kv_caches = distinct_kv_tensors(kv_caches)
    n = len(block_ids)
    view = memoryview(payload)
    if view.nbytes != n * block_bytes(kv_caches):
        raise ValueError(f"{view.nbytes} bytes for {n} blocks of {block_bytes(kv_caches)}")
    if view.readonly:
        view = memoryview(bytearray(view))  # NOTE: torch refuses to wrap a read-only buffer (bytes)
    first = _bytes_view(kv_caches[0])
    # (n, tensors, 2, bs, kvh, hd * itemsize)
    blocks = torch.frombuffer(view, dtype=torch.uint8).view(n, len(kv_caches), *first.shape[:1], *first.shape[2:])
    blocks = blocks.to(first.device)
    index = torch.tensor(block_ids, dtype=torch.long, device=first.device)
    for j, kv in enumerate(kv_caches):
        _bytes_view(kv).index_copy_(1, index, blocks[:, j].transpose(0, 1))


def _bytes_view(kv: torch.Tensor) -> torch.Tensor:
    """(2, blocks, bs, kvh, hd) of any dtype as (2, blocks, bs, kvh, hd * itemsize) uint8, the same memory."""
    return kv.view(torch.uint8)
