"""``python -m scheduler`` with a worker whose hello says hybrid KV-cache groups (a full
group and a sliding window of 32 tokens), over real sockets: the outputs are the
deterministic ones (kvtest.fake_worker), every plan applies cleanly to a replica of the
worker's per-group tables (kvtest.group_tables) and nulls sliding entries, a shared
prefix hits (from its junction on), the pool is empty at the end; with --kv-offloading-size a prefix
pushed out of the device comes back from the host tier in every group."""

from __future__ import annotations

import msgspec
import pytest
from kvtest.group_tables import GroupTables
from kvtest.scheduler_harness import (
    Setup,
    WorkerThread,
    expected_tokens,
    metric,
    prompt_of,
    tokens_of,
)

from protocol.worker_messages import NulledBlocks

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(120)]
WINDOWS = [0, 32]


class HybridWorkerThread(WorkerThread):
    """A WorkerThread whose hello says ``group_windows``; its plans also rebuild the groups' tables."""

    def __init__(self, *args, group_windows: list[int], **kw):
        self.group_windows = group_windows
        self.tables = GroupTables(len(group_windows))
        self.num_nulled = 0
        super().__init__(*args, **kw)

    def _hello(self):
        return msgspec.structs.replace(super()._hello(), group_windows=self.group_windows)

    def _execute(self, plan):
        try:
            self.tables.apply(plan)
        except (AssertionError, KeyError) as e:
            self.errors.append(f"step {plan.step_id}: groups: {e!r}")
        self.num_nulled += sum(type(a) is NulledBlocks for a in plan.appended)
        return super()._execute(plan)


@pytest.fixture
def setup():
    s = Setup(start_worker=False)
    try:
        s.worker = HybridWorkerThread(s.ctx, s.sched.worker_address, group_windows=WINDOWS)
        assert s.worker.ready.wait(10), "no WorkerReady"
        s.sched.wait_health(200)
        yield s
    finally:
        s.close()


def test_hybrid_groups_serve_over_real_sockets(setup):
    client, worker = setup.client, setup.worker
    shared = prompt_of(3, 64)
    prompts = [shared + prompt_of(10 + i, 20) for i in range(3)]
    for i, prompt in enumerate(prompts):
        assert tokens_of(client.generate(f"r{i}", prompt, 40)) == expected_tokens(prompt, 40)
    assert worker.errors == []
    assert worker.num_nulled > 0
    m = setup.wait_idle()
    # Sliding groups cache only the 2-block tails at a request's replay boundary and
    # junction (vLLM serve's retention 0): the first caches its tail at its prompt's end
    # (83), past the 4 shared blocks, so the second misses; its lookup (full attention
    # hit 64 tokens) sets its junction at 64, so the third hits the 64 shared tokens.
    assert metric(m, "vllm:prefix_cache_hits_total") == 64


def test_a_host_tier_serves_hybrid_groups():
    s = Setup("--kv-offloading-size", "0.01", start_worker=False)
    try:
        s.worker = HybridWorkerThread(s.ctx, s.sched.worker_address, group_windows=WINDOWS, num_host_blocks=128)
        assert s.worker.ready.wait(10), "no WorkerReady"
        s.sched.wait_health(200)
        # A's 160 tokens cache 10 full blocks and a 2-block sliding tail; six other prompts
        # push them out of the 63-block pool into the host tier. A again hits 144 tokens
        # there (its last token is computed): 9 full blocks and sliding 7, 8 (the window of
        # 144 reads from 113 on), 11 loads; the fake worker checks group 0's reads.
        a = prompt_of(5, 160)
        for i, prompt in enumerate([a, *(prompt_of(20 + i, 160) for i in range(6)), a]):
            assert tokens_of(s.client.generate(f"r{i}", prompt, 8)) == expected_tokens(prompt, 8)
        assert s.worker.errors == []
        m = s.wait_idle()
        assert metric(m, "kvpool_kv_offload_loaded_blocks_total") == 11
    finally:
        s.close()
