"""The external KV tier a worker opens at start-up, from its flags (--kv-offloading-backend)."""

from __future__ import annotations

import logging

import torch

from worker.config import WorkerConfig
from worker.external.external_io import ExternalIO
from worker.external.store_errors import StoreError
from worker.kv.kv_block_bytes import kv_block_identity
from worker.kv.kv_cache import distinct_kv_tensors
from worker.load.serving_model import ServingModel

log = logging.getLogger("kvpool.worker.external")


def open_external_tier(config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor]) -> ExternalIO | None:
    """The tier of ``config.kv_offloading_backend`` (None without one). Raises ValueError
    naming the problem: a directory it cannot use, a store out of reach. Its blocks move
    across the distinct KV tensors (a hybrid model's shared tensors once), and the identity
    names that layout and the KV-cache groups (worker/kv/kv_block_bytes.py)."""
    backend = config.kv_offloading_backend
    if not backend:
        return None
    kv_caches = distinct_kv_tensors(kv_caches)
    identity = kv_block_identity(serving, kv_caches, config.block_size)
    if backend == "disk":
        from worker.external.disk_store import DiskStore

        store = DiskStore(config.kv_offloading_path, config.kv_offloading_disk_bytes, identity)
        log.info("disk tier at %s: %d blocks held, bounded at %d bytes", store.dir, len(store), store.max_bytes)
    elif backend == "mooncake":
        from worker.external.mooncake_store import MooncakeStore

        try:
            store = MooncakeStore(config.mooncake_master, config.mooncake_metadata)
        except StoreError as e:
            raise ValueError(f"--kv-offloading-backend mooncake: {e}") from e
        log.info("Mooncake Store tier: master %s, metadata %s", config.mooncake_master, config.mooncake_metadata)
    else:
        raise ValueError(f"unknown --kv-offloading-backend {backend!r}")
    return ExternalIO(store, identity, kv_caches)
