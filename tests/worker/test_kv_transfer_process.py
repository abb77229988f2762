"""P/D disaggregation between two ``python -m worker`` processes, each driven by a fake
scheduler: the prefill worker computes a prompt and lends its full blocks; the decode
worker pulls them into other block ids (KVTransferDone: all blocks written; the prefill
worker's: read) and generates the reference model's tokens from them, computing only the
last prompt token."""

from __future__ import annotations

import json
import re
import urllib.request

import pytest
from kvtest.fake_scheduler import STARTUP_S, FakeScheduler, free_port
from kvtest.hf_models import reference_generate
from kvtest.worker_proc import worker_process

from protocol.worker_messages import (
    KVTransferDone,
    KVTransferOps,
    RequestRow,
    Shutdown,
    StepPlan,
    StepResult,
    WorkerHello,
    WorkerReady,
)

pytestmark = pytest.mark.e2e

PROMPT = [3, 14, 15, 92, 65, 35, 8, 9, 10]  # 2 full blocks and 1 token


def kv_transfer_flag(role: str) -> list[str]:
    config = {"kv_connector": "NixlConnector", "kv_role": role, "kv_connector_extra_config": {"read_timeout": 10}}
    return ["--kv-transfer-config", json.dumps(config)]


def recv_both(sched: FakeScheduler, timeout_s: float) -> tuple[KVTransferDone, StepResult]:
    """A step's result and the KV transfer news, in either order (a pull may end after the step)."""
    got: dict[type, object] = {}
    while len(got) < 2:
        msg = sched.recv(timeout_s)
        assert isinstance(msg, (KVTransferDone, StepResult)), msg
        got[type(msg)] = msg
    return got[KVTransferDone], got[StepResult]


def test_blocks_a_prefill_worker_lends_are_pulled_and_decoded_from(tiny_reference):
    expected = reference_generate(tiny_reference, PROMPT, 2)
    sp, sd, port = FakeScheduler(), FakeScheduler(), free_port()
    try:
        with (worker_process(sp.endpoint, "--http-port", "0", *kv_transfer_flag("kv_producer")) as prefill,
              worker_process(sd.endpoint, "--http-port", str(port), *kv_transfer_flag("kv_consumer")) as decode):
            hp, hd = sp.recv(STARTUP_S), sd.recv(STARTUP_S)
            assert isinstance(hp, WorkerHello) and isinstance(hd, WorkerHello)
            assert hp.kv_transfer_address.startswith("127.0.0.1:") and hd.kv_transfer_address == ""
            assert hp.kv_transfer_identity == hd.kv_transfer_identity != ""
            for sched in (sp, sd):
                sched.send(WorkerReady(64, 4, 4, 64))
            # Prefill: seq 7's prompt, 2 full blocks (9, 2) and 1 token; then lent as it finishes.
            sp.send(StepPlan(0, {7: 9}, new_rows=[RequestRow(7, PROMPT, [9, 2, 30])]))
            assert sp.recv(10).sampled_token_ids == expected[:1]
            sp.send(StepPlan(1, {}, finished_seq_ids=[7], kv_transfer=KVTransferOps(lend_ids=["req-7"], lend_block_ids=[[[9, 2]]])))
            assert isinstance(sp.recv(10), StepResult)
            # Decode: the 2 blocks pulled into 40 and 41, beside an empty step.
            ops = KVTransferOps(pull_ids=[9], pull_addresses=[hp.kv_transfer_address], pull_request_ids=["req-7"],
                                pull_remote_block_ids=[[[9, 2]]], pull_block_ids=[[40, 41]])
            sd.send(StepPlan(0, {}, kv_transfer=ops))
            done, _ = recv_both(sd, 15)
            assert done == KVTransferDone(pulled={9: 2})
            assert sp.recv(10) == KVTransferDone(sent=["req-7"])
            # Seq 9, the same prompt: 8 tokens pulled, 1 computed.
            sd.send(StepPlan(1, {9: 1}, new_rows=[RequestRow(9, PROMPT, [40, 41, 42], num_computed_tokens=8)]))
            r1 = sd.recv(10)
            sd.send(StepPlan(2))
            r2 = sd.recv(10)
            assert r1.sampled_token_ids + r2.sampled_token_ids == expected
            body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            m = re.search(r"^kvpool_kv_transfer_pulled_blocks_total\{[^}]*\} (\S+)$", body, re.MULTILINE)
            assert m is not None and float(m.group(1)) == 2
            for sched, proc in ((sp, prefill), (sd, decode)):
                sched.send(Shutdown("test over"))
                assert proc.wait(timeout=10) == 0
    finally:
        sp.close()
        sd.close()
