"""The scheduler builds its pool from the first worker's hello: the hybrid manager when
the hello's KV-cache groups say so (several groups, or one sliding group), the one-group
KVCacheManager otherwise -- with priority scheduling, their priority subclasses."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from protocol.worker_messages import WorkerHello
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.core.retention.priority_retention import PriorityKVCacheManager
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.worker_side import WorkerSide


def build(group_windows: list[int], **config):
    hello = WorkerHello(
        rank=0,
        world_size=1,
        num_blocks=64,
        block_size=16,
        vocab_size=512,
        eos_token_id=1,
        group_windows=group_windows,
    )
    side = SimpleNamespace(
        config=dataclasses.replace(SchedulerConfig(), **config), state=SimpleNamespace(kv=None, scheduler=None),
        kv_event_sink=None, metrics=SimpleNamespace(set_cache_config_info=lambda info: None), pool_group_windows=None,
    )
    WorkerSide._build_pool(side, hello, 64)
    return side


@pytest.mark.parametrize(
    "windows,policy,cls",
    [
        ([], "fcfs", KVCacheManager),
        ([0], "fcfs", KVCacheManager),
        ([512] * 5 + [0], "fcfs", KVCacheManager),
        ([4096], "fcfs", KVCacheManager),
        ([512, 0], "priority", PriorityKVCacheManager),
        ([], "priority", PriorityKVCacheManager),
    ],
)
def test_the_pool_follows_the_hellos_groups(windows, policy, cls):
    side = build(windows, scheduling_policy=policy)
    kv = side.state.kv
    assert type(kv) is cls and side.pool_group_windows == windows
    assert side.state.scheduler.kv_cache_manager is kv
    assert kv.block_pool.num_gpu_blocks == 64
    if windows not in ([], [0]):
        assert kv.group_windows == windows and kv.num_groups == len(windows)
        assert kv.pinned.num_pinned_blocks == 0
    else:
        assert kv.num_groups == 1


def test_metrics_read_the_one_hybrid_pool():
    from scheduler.core.hashing import BlockHasher
    from scheduler.engine.metrics import SchedulerMetrics
    from scheduler.sched.request import Request

    side = build([8, 0], block_size=16)
    sched, kv = side.state.scheduler, side.state.kv
    sched.add_request(Request("a", list(range(2, 42)), 4, block_hasher=BlockHasher(16)))
    sched.schedule()  # 40 tokens: 3 blocks in each group
    metrics = SchedulerMetrics("m")
    metrics.update_waiting_gauges(sched)
    metrics.update_step_gauges(sched, kv)
    metrics.update(sched, kv)
    values = {
        line.split("{")[0]: float(line.split()[-1])
        for line in metrics.render().decode().splitlines()
        if not line.startswith("#")
    }
    assert values["vllm:kv_cache_usage_perc"] == pytest.approx(6 / 63)  # 3 blocks in each group
    assert values["kvpool_kv_cache_token_usage_perc"] == pytest.approx(
        80 / (63 * 16)
    )  # 40 tokens in each group
    assert values["vllm:prefix_cache_queries_total"] == 40
