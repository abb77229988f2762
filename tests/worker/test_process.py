"""``python -m worker`` as a real process against a fake scheduler ROUTER socket.

Every wait is bounded by a poll timeout and the process is always killed in a finally.
"""

from __future__ import annotations

import time
import urllib.request

import pytest
import torch
from kvtest.fake_scheduler import STARTUP_S, FakeScheduler, free_port
from kvtest.hf_models import reference_generate
from kvtest.worker_proc import worker_process

from protocol.worker_messages import (
    Heartbeat,
    RequestRow,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerHello,
    WorkerReady,
)

pytestmark = pytest.mark.e2e

def handshake(sched: FakeScheduler, **ready) -> WorkerHello:
    hello = sched.recv(STARTUP_S)
    assert isinstance(hello, WorkerHello)
    sched.send(WorkerReady(**{"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, "max_model_len": 64, **ready}))
    return hello


def test_hello_plans_heartbeat_metrics_and_shutdown(tiny_reference):
    prompt = [3, 14, 15, 92, 65, 35]
    expected = reference_generate(tiny_reference, prompt, 3)
    sched, port = FakeScheduler(), free_port()
    try:
        with worker_process(sched.endpoint, "--http-port", str(port), "--served-model-name", "tiny") as proc:
            hello = handshake(sched)
            # 1 MiB / (2 * 4 layers * 4 tokens * 2 kv heads * 32 dims * 8 bytes)
            assert (hello.num_blocks, hello.block_size, hello.vocab_size, hello.eos_token_id) == (64, 4, 512, 1)
            assert (hello.num_layers, hello.num_kv_heads, hello.head_dim, hello.device) == (4, 2, 32, "cpu")
            assert (hello.architecture, hello.eos_token_ids, hello.max_model_len) == ("LlamaForCausalLM", [1], 131072)
            assert len(hello.model_hash) == 32
            sched.send(StepPlan(0, {7: 4}, new_rows=[RequestRow(7, prompt, [9, 2])]))
            r0 = sched.recv(10)
            assert isinstance(r0, StepResult) and r0.step_id == 0 and r0.seq_ids == []
            sched.send(StepPlan(1, {7: 2}))
            r1 = sched.recv(10)
            assert (r1.step_id, r1.seq_ids, r1.sampled_token_ids) == (1, [7], expected[:1])
            assert r1.execute_time_s > 0
            sched.send(StepPlan(5))  # a gap: refused, state unchanged
            err = sched.recv(10)
            assert isinstance(err, WorkerError) and err.step_id == 5 and "gap" in err.message
            sched.send(StepPlan(2))
            r2 = sched.recv(10)
            assert (r2.step_id, r2.seq_ids, r2.sampled_token_ids) == (2, [7], expected[1:2])
            # Idle: the worker says it is alive about every 0.5 s.
            sched.send(Heartbeat(time.time()))
            assert isinstance(sched.recv(3, skip_heartbeats=False), Heartbeat)
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            for name in ("kvpool_worker_step_duration_seconds_bucket", "kvpool_worker_tokens_computed_total",
                         "kvpool_worker_kv_bytes_written_total", "kvpool_worker_steps_total", "kvpool_worker_num_blocks"):
                assert name in body, name
            # labelled with the served name, as the scheduler's and the API's families are
            assert 'kvpool_worker_tokens_computed_total{engine="0",model_name="tiny"} 7.0' in body
            assert 'kvpool_worker_num_blocks{engine="0",model_name="tiny"} 64.0' in body
            sched.send(Shutdown("test over"))
            assert proc.wait(timeout=10) == 0
    finally:
        sched.close()


def test_exits_nonzero_when_the_scheduler_goes_silent():
    sched = FakeScheduler()
    try:
        with worker_process(sched.endpoint, "--http-port", "0", "--scheduler-timeout", "0.5") as proc:
            handshake(sched)
            t0 = time.monotonic()
            rc = proc.wait(timeout=15)
            assert rc != 0 and time.monotonic() - t0 < 10
            _, err = proc.communicate(timeout=5)
            assert "no message from the scheduler" in err and "--scheduler-timeout" in err
    finally:
        sched.close()


def test_reconnect_handshakes_again_with_no_rows(tiny_reference):
    prompt = [5, 6, 7]
    sched = FakeScheduler()
    try:
        # NOTE: 2 s, not less: each exchange below must fit in one timeout on a loaded
        # machine, or the worker handshakes again and the rest goes to its old socket.
        with worker_process(sched.endpoint, "--http-port", "0", "--scheduler-timeout", "2", "--reconnect") as proc:
            handshake(sched)
            sched.send(StepPlan(0, {3: 3}, new_rows=[RequestRow(3, prompt, [8])]))
            assert isinstance(sched.recv(10), StepResult)
            hello = sched.recv(10)  # silence: the worker drops its rows and says hello again
            assert isinstance(hello, WorkerHello)
            sched.send(WorkerReady(64, 4, 4, 64, next_step_id=40))
            sched.send(StepPlan(40, {3: 1}))  # row 3 went with the old handshake
            err = sched.recv(10)
            assert isinstance(err, WorkerError) and err.step_id == 40
            sched.send(StepPlan(40, {3: 3}, new_rows=[RequestRow(3, prompt, [8])]))
            res = sched.recv(10)
            assert (res.step_id, res.seq_ids, res.sampled_token_ids) == (40, [3], reference_generate(tiny_reference, prompt, 1))
            sched.send(Shutdown())
            assert proc.wait(timeout=10) == 0
    finally:
        sched.close()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_bfloat16_worker_serves_a_step():
    sched = FakeScheduler()
    try:
        with worker_process(sched.endpoint, "--http-port", "0", "--device", "cuda", "--dtype", "bfloat16") as proc:
            hello = handshake(sched)
            assert hello.device.startswith("cuda") and hello.num_blocks >= 64
            sched.send(StepPlan(0, {7: 6}, new_rows=[RequestRow(7, [3, 14, 15, 92, 65, 35], [9, 2])]))
            res = sched.recv(30)
            assert isinstance(res, StepResult) and res.seq_ids == [7] and 0 <= res.sampled_token_ids[0] < 512
            sched.send(Shutdown())
            assert proc.wait(timeout=10) == 0
    finally:
        sched.close()
