"""``python -m worker`` as a real process, serving a hybrid checkpoint with a host tier and
a disk tier: it starts (the tiers were refused for hybrid models), its hello counts the
block bytes both tiers move, its host tier copies a block of every group through plans,
and it stops at Shutdown. Every wait is bounded and the process is always killed.

The tiny Gemma-3-style checkpoint: 6 layers, 5 sliding (window 128) and 1 full, so 6
KV-cache groups of one layer sharing one KV tensor. 2 KV heads of 32 dims in float32 at
block size 4: a block is 1 tensor * 2 * 4 * 2 * 32 * 4 = 2048 bytes (not 6 layers'
12288), so 1 MiB holds 512 device blocks and 1/1024 GiB 512 host blocks.
"""

from __future__ import annotations

import pytest
from kvtest.fake_scheduler import STARTUP_S, FakeScheduler
from kvtest.worker_proc import worker_process

from protocol.worker_messages import (
    GroupRequestRow,
    Shutdown,
    StepPlan,
    StepResult,
    TierCopies,
    WorkerHello,
    WorkerReady,
)
from worker.tiny.gemma3 import gemma3_checkpoint

pytestmark = pytest.mark.e2e


def test_a_hybrid_worker_serves_with_a_host_tier_and_a_disk_tier(tmp_path):
    sched = FakeScheduler()
    flags = ["--model", str(gemma3_checkpoint()), "--http-port", "0", "--kv-offloading-size", str(1 / 1024),
             "--kv-offloading-backend", "disk", "--kv-offloading-path", str(tmp_path), "--kv-offloading-disk-size", "0.001"]
    try:
        with worker_process(sched.endpoint, *flags, dtype="float32") as proc:
            hello = sched.recv(STARTUP_S)
            assert isinstance(hello, WorkerHello), hello
            assert hello.group_windows == [128, 128, 128, 128, 128, 0]
            assert hello.kv_block_bytes == 2048 and hello.num_blocks == 512 and hello.num_host_blocks == 512
            assert hello.external_tier == "disk" and hello.external_keys == []
            assert [p.name for p in tmp_path.iterdir()] == [hello.external_identity]
            sched.send(WorkerReady(64, 4, 2, 64, num_host_blocks=8))
            # One block of 4 tokens in each of the 6 groups, then each stored and loaded into another block.
            row = GroupRequestRow(7, [3, 14, 15, 92], [1], group_block_ids=[[2], [3], [4], [5], [6]])
            sched.send(StepPlan(0, {7: 4}, new_rows=[row]))
            assert isinstance(sched.recv(30), StepResult)
            copies = TierCopies(list(range(1, 7)), list(range(6)), list(range(6)), list(range(11, 17)))
            sched.send(StepPlan(1, {}, finished_seq_ids=[7], tier_copies=copies))
            assert isinstance(sched.recv(30), StepResult)
            sched.send(Shutdown("test over"))
            assert proc.wait(timeout=10) == 0
    finally:
        sched.close()
