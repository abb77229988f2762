"""The external KV tier as the scheduler process sets it up: built from its flags, and
checked against each worker's hello (the worker holds the tier; both must name the same)."""

from __future__ import annotations

from protocol.worker_messages import WorkerHello
from scheduler.core.offload.external_tier import ExternalTier, KnownKeys
from scheduler.engine.worker_checks import WorkerRefused


def make_external_tier(backend: str, block_size: int, mooncake_master: str | None, mooncake_metadata: str | None) -> ExternalTier | None:
    """The tier of ``--kv-offloading-backend`` (None for native: the host tier alone)."""
    if backend == "native":
        return None
    if backend == "disk":
        return ExternalTier(backend, block_size, KnownKeys())
    if backend == "mooncake":
        from scheduler.core.offload.mooncake_index import MooncakeKeyIndex

        return ExternalTier(backend, block_size, MooncakeKeyIndex(mooncake_master, mooncake_metadata))
    raise ValueError(f"unknown --kv-offloading-backend {backend!r}")


def check_external_tier(hello: WorkerHello, backend: str) -> None:
    """WorkerRefused unless the worker holds the external tier this scheduler manages."""
    want = "" if backend == "native" else backend
    if hello.external_tier != want:
        has = hello.external_tier or "none"
        raise WorkerRefused(f"the worker's external KV tier is {has}, this scheduler's --kv-offloading-backend is {backend}: "
                            "give both the same --kv-offloading-backend")
    if want and len(hello.external_identity) != 32:
        raise WorkerRefused(f"the worker's external tier identity {hello.external_identity!r} is not 32 hex digits")
