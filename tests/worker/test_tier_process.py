"""``python -m worker --kv-offloading-size`` as a real process: the host tier it
allocates before hello, the WorkerReady that sizes it, a prefix stored and loaded
back through plans, the copies' vLLM metrics; and a size the host cannot hold, exit 2.
Every wait is bounded and the process is always killed in a finally."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch
from kvtest.fake_scheduler import STARTUP_S, FakeScheduler, free_port
from kvtest.hf_models import reference_generate
from kvtest.worker_proc import worker_process

from protocol.worker_messages import (
    RequestRow,
    Shutdown,
    StepPlan,
    StepResult,
    TierCopies,
    WorkerError,
    WorkerHello,
    WorkerReady,
)
from worker.config import WorkerConfig
from worker.kv.kv_cache import allocate_host_kv_caches, allocate_kv_caches
from worker.load.serving_model import load_serving_model
from worker.process import WorkerProcess

pytestmark = pytest.mark.e2e

# The tiny checkpoint in float64 at block size 4: 2 * 4 layers * 4 tokens * 2 kv heads
# * 32 dims * 8 bytes = 16 KiB a block, so 1/1024 GiB (1 MiB) holds 64 host blocks.
BLOCK_BYTES, TIER_GIB, TIER_BLOCKS = 16384, 1 / 1024, 64
PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 10]  # 2 full blocks and 1 token


def metric(body: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", body, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def test_a_prefix_stored_and_loaded_back_through_plans(tiny_reference):
    expected = reference_generate(tiny_reference, PROMPT, 2)
    sched, port = FakeScheduler(), free_port()
    try:
        with worker_process(sched.endpoint, "--http-port", str(port), "--kv-offloading-size", str(TIER_GIB)) as proc:
            hello = sched.recv(STARTUP_S)
            assert isinstance(hello, WorkerHello) and hello.num_host_blocks == TIER_BLOCKS
            sched.send(WorkerReady(64, 4, 4, 64, num_host_blocks=16))
            sched.send(StepPlan(0, {7: 9}, new_rows=[RequestRow(7, PROMPT, [9, 2, 30])]))
            first = sched.recv(10)
            assert isinstance(first, StepResult) and first.sampled_token_ids == expected[:1]
            # Seq 7 finishes; its full blocks go to host slots 15 and 0 (slot 16 is past
            # the 16 the scheduler chose: refused, nothing applied).
            sched.send(StepPlan(1, {}, finished_seq_ids=[7], tier_copies=TierCopies([9, 2], [15, 16])))
            err = sched.recv(10)
            assert isinstance(err, WorkerError) and "host slot 16 is outside the tier (valid slots 0..15)" in err.message
            sched.send(StepPlan(1, {}, finished_seq_ids=[7], tier_copies=TierCopies([9, 2], [15, 0])))
            assert isinstance(sched.recv(10), StepResult)
            # The blocks are reused by another request, which finishes.
            sched.send(StepPlan(2, {8: 8}, new_rows=[RequestRow(8, [5] * 8, [9, 2])]))
            sched.recv(10)
            sched.send(StepPlan(3, {}, finished_seq_ids=[8]))
            sched.recv(10)
            # Seq 9 has the same prompt: 8 tokens loaded from the host tier, 1 computed.
            tc = TierCopies(load_host_ids=[15, 0], load_device_ids=[40, 41])
            sched.send(StepPlan(4, {9: 1}, new_rows=[RequestRow(9, PROMPT, [40, 41, 42], num_computed_tokens=8)], tier_copies=tc))
            r4 = sched.recv(10)
            sched.send(StepPlan(5))
            r5 = sched.recv(10)
            assert r4.sampled_token_ids + r5.sampled_token_ids == expected
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            assert metric(body, "vllm:kv_offload_store_bytes_total") == 2 * BLOCK_BYTES
            assert metric(body, "vllm:kv_offload_load_bytes_total") == 2 * BLOCK_BYTES
            assert metric(body, "vllm:kv_offload_store_size_count") == 1
            assert metric(body, "vllm:kv_offload_load_time_total") > 0
            assert 'vllm:kv_offload_total_bytes_total{engine="0",model_name="kvpool-tiny",transfer_type="CPU_to_GPU"} 32768.0' in body
            assert metric(body, "kvpool_worker_host_kv_bytes") == TIER_BLOCKS * BLOCK_BYTES
            assert metric(body, "kvpool_worker_num_host_blocks") == 16
            sched.send(Shutdown("test over"))
            assert proc.wait(timeout=10) == 0
    finally:
        sched.close()


def test_a_host_tier_the_host_cannot_hold_exits_2():
    sched = FakeScheduler()
    try:
        with worker_process(sched.endpoint, "--http-port", "0", "--kv-offloading-size", "1000000") as proc:
            assert proc.wait(timeout=STARTUP_S) == 2
            _, err = proc.communicate(timeout=5)
            assert "host KV tier of 976.6 TiB does not fit" in err and "lower --kv-offloading-size" in err
    finally:
        sched.close()


def test_worker_ready_sizes_or_drops_the_host_tier(tiny_checkpoint):
    serving = load_serving_model(tiny_checkpoint, "float32", "cpu")
    c = serving.config
    kv = allocate_kv_caches(c.num_layers, 8, 4, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    proc = WorkerProcess(WorkerConfig(block_size=4), serving, kv, None, allocate_host_kv_caches(kv, 6))
    assert proc.hello().num_host_blocks == 6
    why = proc._install(WorkerReady(8, 4, 2, 64, num_host_blocks=7))
    assert why == "WorkerReady num_host_blocks 7 is outside 0..6 (the host tier this worker holds)"
    assert proc._install(WorkerReady(8, 4, 2, 64, num_host_blocks=3)) is None
    assert proc.runner.tier.num_host_blocks == 3 and proc.hello().num_host_blocks == 6
    # A scheduler that wants no host tier: the worker frees it and offers none again.
    assert proc._install(WorkerReady(8, 4, 2, 64)) is None
    assert proc.runner.tier is None and proc.host_caches is None and proc.hello().num_host_blocks == 0


@pytest.mark.parametrize(("value", "words"), [("-1", "expected a number of GiB >= 0"), ("lots", "expected a number of GiB, e.g. 4 or 0.5"),
                                             ("inf", "expected a number of GiB >= 0")])
def test_a_bad_kv_offloading_size_is_refused_naming_it(value, words, capsys):
    from worker.__main__ import config_from_args

    with pytest.raises(SystemExit) as e:
        config_from_args(["--device", "cpu", "--kv-offloading-size", value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-offloading-size" in err and words in err
    assert config_from_args(["--device", "cpu", "--kv-offloading-size", "0.5"]).kv_offloading_size == 0.5
