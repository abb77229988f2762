"""The device pool's eviction policies by name (``--kv-eviction-policy``), and the
pool factory and manager class for a choice.

``lru`` is the free queue's own order (`free_block_queue.py`): the plain pool, no
policy object. Every other name is a `BlockPolicy` (`block_policy.py`) ordering
the free cached blocks. With ``--scheduling-policy priority`` the blocks are kept
by the freeing request's priority first (`priority_retention.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from scheduler.core.block_pool import BlockPool
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.arc_policy import ARCBlockPolicy
from scheduler.core.retention.block_policy import BlockPolicy, LRUBlockPolicy
from scheduler.core.retention.cost_policy import CostBlockPolicy
from scheduler.core.retention.lfu_policy import LFUBlockPolicy
from scheduler.core.retention.policy_free_queue import policy_pool_factory
from scheduler.core.retention.priority_retention import PriorityBlockPolicy, PriorityKVCacheManager
from scheduler.core.retention.s3fifo_policy import S3FIFOBlockPolicy

KV_EVICTION_POLICIES = ("lru", "arc", "lfu", "s3fifo", "cost")

_POLICIES: dict[str, Callable[[int], BlockPolicy]] = {
    "lru": LRUBlockPolicy, "arc": ARCBlockPolicy, "lfu": LFUBlockPolicy, "s3fifo": S3FIFOBlockPolicy, "cost": CostBlockPolicy,
}


def check_eviction_policy(name: str) -> None:
    if name not in KV_EVICTION_POLICIES:
        raise ValueError(f"unknown KV eviction policy {name!r}; choose one of {', '.join(KV_EVICTION_POLICIES)}")


def by_priority(scheduling_policy: str) -> bool:
    """Whether blocks are retained by their request's priority."""
    return scheduling_policy == "priority"


def eviction_pool_factory(name: str, scheduling_policy: str = "fcfs", base: Callable[..., BlockPool] = BlockPool) -> Callable[..., BlockPool]:
    """The `KVCacheManager` pool_factory for policy ``name``: ``base`` itself for
    ``lru`` (unless retained by priority), else ``base`` with a policy's queue."""
    check_eviction_policy(name)
    make = _POLICIES[name]
    if by_priority(scheduling_policy):
        make = partial(PriorityBlockPolicy, make_policy=make)
    elif name == "lru":
        return base
    return policy_pool_factory(make, base)


def kv_cache_manager_class(scheduling_policy: str = "fcfs") -> type[KVCacheManager]:
    """The manager for ``scheduling_policy`` (one KV-cache group or several)."""
    return PriorityKVCacheManager if by_priority(scheduling_policy) else KVCacheManager
