"""A plan's P/D disaggregation ops at the process loop (worker/transfer/plan_ops.py,
ops_check.py): a bad plan is refused whole (PlanError) and changes nothing; a good one
unlends then lends before its forward, and starts its pulls beside it, or after it when
the plan has host-tier copies; the hello takes an earlier scheduler's lends back. A
kv_both worker pulls from its own server here, over a real loopback socket."""

from __future__ import annotations

import pytest
import torch

from protocol.worker_messages import KVTransferOps, StepPlan, TierCopies
from worker.step.plan_check import PlanError
from worker.transfer import plan_ops
from worker.transfer.kv_puller import KVPuller
from worker.transfer.kv_server import KVServer
from worker.transfer.kv_transfer import KVTransfer

IDENTITY = "ab" * 16
NUM_BLOCKS = 10
BOUND_S = 10.0


def make_transfer(producer: bool = True, consumer: bool = True) -> KVTransfer:
    g = torch.Generator().manual_seed(3)
    caches = [torch.randn(2, NUM_BLOCKS, 4, 1, 8, generator=g) for _ in range(2)]  # per layer (2, blocks, bs, kvh, hd)
    server = KVServer(caches, IDENTITY, "127.0.0.1", 0, lend_wait_s=0.2) if producer else None
    puller = KVPuller(caches, IDENTITY, BOUND_S) if consumer else None
    return KVTransfer(IDENTITY, server, puller)


@pytest.fixture
def transfer():
    t = make_transfer()
    yield t
    t.close()


def pulls(address: str, request_id: str = "r", remote=(3,), local=(5,), pull_id: int = 1) -> dict:
    return dict(pull_ids=[pull_id], pull_addresses=[address], pull_request_ids=[request_id],
                pull_remote_block_ids=[[list(remote)]], pull_block_ids=[list(local)])


def run_step(transfer: KVTransfer, plan: StepPlan) -> tuple[dict[int, int], list[str]] | None:
    started = plan_ops.before_step(transfer, plan, NUM_BLOCKS)
    plan_ops.after_step(transfer, plan, started)
    assert transfer.puller.drain(BOUND_S)
    return transfer.take_done()


def test_a_plan_lends_then_its_pulls_read_the_lend(transfer):
    ops = KVTransferOps(lend_ids=["r"], lend_block_ids=[[[4, 3]]], **pulls(transfer.server.address, remote=[4, 3], local=[5, 6]))
    plan = StepPlan(0, kv_transfer=ops)
    assert plan_ops.before_step(transfer, plan, NUM_BLOCKS) is True  # started beside the forward
    plan_ops.after_step(transfer, plan, True)
    assert transfer.puller.drain(BOUND_S)
    assert transfer.take_done() == ({1: 2}, ["r"])
    assert transfer.take_done() is None
    kv = transfer.puller.kv_caches[0]
    assert torch.equal(kv[:, 5], kv[:, 4]) and torch.equal(kv[:, 6], kv[:, 3])


def test_a_plan_lends_and_pulls_every_kv_cache_groups_blocks(transfer):
    # A hybrid model's request: a full-attention group's blocks 4 3 2, a sliding group's tail 7;
    # the pull reads the groups' runs into 5 6 8 (the full group's last two, then the sliding one's).
    ops = KVTransferOps(lend_ids=["r"], lend_block_ids=[[[4, 3, 2], [7]]], pull_ids=[1], pull_addresses=[transfer.server.address],
                        pull_request_ids=["r"], pull_remote_block_ids=[[[3, 2], [7]]], pull_block_ids=[[5, 6, 8]])
    assert run_step(transfer, StepPlan(0, kv_transfer=ops)) == ({1: 3}, ["r"])
    kv = transfer.puller.kv_caches[0]
    assert all(torch.equal(kv[:, a], kv[:, b]) for a, b in ((5, 3), (6, 2), (8, 7)))


def test_pulls_of_a_plan_with_host_tier_copies_start_after_it(transfer):
    transfer.server.lend("r", [[3]])
    plan = StepPlan(0, tier_copies=TierCopies(), kv_transfer=KVTransferOps(**pulls(transfer.server.address)))
    assert plan_ops.before_step(transfer, plan, NUM_BLOCKS) is False
    assert not transfer.puller.has_pending
    plan_ops.after_step(transfer, plan, False)
    assert transfer.puller.drain(BOUND_S)
    assert transfer.take_done() == ({1: 1}, ["r"])


def test_unlends_come_before_lends(transfer):
    transfer.server.lend("old", [[2]])
    ops = KVTransferOps(unlend_ids=["old", "r"], lend_ids=["r"], lend_block_ids=[[[3]]])
    assert run_step(transfer, StepPlan(0, kv_transfer=ops)) is None
    assert transfer.server._lends == {"r": [[3]]}


ADDRESS = "127.0.0.1:1"


@pytest.mark.parametrize(
    ("ops", "words"),
    [
        (KVTransferOps(lend_ids=["a", "b"], lend_block_ids=[[[1]]]), "KV lends: 2 ids for 1 block lists"),
        (KVTransferOps(lend_ids=["a", "a"], lend_block_ids=[[[1]], [[2]]]), "KV lends: an id repeats"),
        (KVTransferOps(lend_ids=["a"], lend_block_ids=[[[]]]), "KV lend 'a': no blocks"),
        (KVTransferOps(lend_ids=["a"], lend_block_ids=[[[1, NUM_BLOCKS]]]), f"block id {NUM_BLOCKS} is outside 1..{NUM_BLOCKS - 1}"),
        (KVTransferOps(lend_ids=["a"], lend_block_ids=[[[0]]]), "block id 0 is outside"),
        (KVTransferOps(**{**pulls(ADDRESS), "pull_block_ids": [[5], [6]]}), "KV pulls: 1, 1, 1, 1, 2 ids"),
        (KVTransferOps(**pulls(ADDRESS, remote=[3, 4], local=[5])), "KV pull 1: 2 remote blocks for 1 local ones"),
        (KVTransferOps(**pulls(ADDRESS, remote=[], local=[])), "KV pull 1: 0 remote blocks for 0 local ones"),
        (KVTransferOps(**{**pulls(ADDRESS), "pull_remote_block_ids": [[[3], [4]]]}), "KV pull 1: 2 remote blocks for 1 local ones"),
        (KVTransferOps(lend_ids=["a"], lend_block_ids=[[[], []]]), "KV lend 'a': no blocks"),
        (KVTransferOps(lend_ids=["a"], lend_block_ids=[[[1], [0]]]), "block id 0 is outside"),
        (KVTransferOps(**pulls(ADDRESS, remote=[0])), "a remote block id below 1"),
        (KVTransferOps(**pulls(ADDRESS, local=[NUM_BLOCKS])), "KV pull 1: block id 10 is outside"),
        (KVTransferOps(**pulls("nowhere")), "KV pull 1: address 'nowhere' is not host:port"),
        (KVTransferOps(pull_ids=[1, 2], pull_addresses=[ADDRESS] * 2, pull_request_ids=["a", "b"], pull_remote_block_ids=[[[1]], [[2]]],
                       pull_block_ids=[[5], [5]]), "a device block is pulled into twice"),
        (KVTransferOps(pull_ids=[1, 1], pull_addresses=[ADDRESS] * 2, pull_request_ids=["a", "b"], pull_remote_block_ids=[[[1]], [[2]]],
                       pull_block_ids=[[5], [6]]), "KV pulls: an id repeats"),
    ],
    ids=["lend-lengths", "lend-repeat", "lend-empty", "lend-range", "lend-null", "pull-lengths", "pull-remote-local",
         "pull-empty", "pull-groups-local", "lend-groups-empty", "lend-group-null", "pull-remote-null", "pull-range", "pull-address", "pull-twice", "pull-repeat"],
)
def test_a_bad_plan_is_refused_and_changes_nothing(transfer, ops, words):
    transfer.server.lend("kept", [[2]])
    # A good unlend and lend ride along: neither may be applied.
    bad = KVTransferOps(**{"unlend_ids": ["kept"], "lend_ids": ["new"], "lend_block_ids": [[[3]]], **{
        k: getattr(ops, k) for k in KVTransferOps.__struct_fields__ if getattr(ops, k)}})
    with pytest.raises(PlanError, match=words.replace("(", r"\(").replace(".", r"\.")):
        plan_ops.before_step(transfer, StepPlan(0, kv_transfer=bad), NUM_BLOCKS)
    assert transfer.server._lends == {"kept": [[2]]}
    assert not transfer.puller.has_pending and transfer.take_done() is None


@pytest.mark.parametrize(
    ("producer", "consumer", "ops", "words"),
    [
        (True, False, KVTransferOps(**pulls(ADDRESS)), "pulls KV blocks, but this worker's kv_role is not kv_consumer"),
        (False, True, KVTransferOps(lend_ids=["a"], lend_block_ids=[[[1]]]), "lends KV blocks, but this worker's kv_role is not kv_producer"),
        (False, True, KVTransferOps(unlend_ids=["a"]), "lends KV blocks, but"),
    ],
)
def test_ops_the_role_does_not_allow_are_refused(producer, consumer, ops, words):
    transfer = make_transfer(producer, consumer)
    try:
        with pytest.raises(PlanError, match=words):
            plan_ops.before_step(transfer, StepPlan(0, kv_transfer=ops), NUM_BLOCKS)
    finally:
        transfer.close()


def test_a_worker_without_kv_transfer_refuses_ops_and_runs_plans_without():
    assert plan_ops.before_step(None, StepPlan(0), NUM_BLOCKS) is False
    with pytest.raises(PlanError, match="no --kv-transfer-config"):
        plan_ops.before_step(None, StepPlan(0, kv_transfer=KVTransferOps()), NUM_BLOCKS)
    with pytest.raises(PlanError, match="no --kv-transfer-config"):
        plan_ops.before_step(None, StepPlan(0, kv_transfer=KVTransferOps(unlend_ids=["a"])), NUM_BLOCKS)
    assert plan_ops.hello_fields(None) == {}


def test_the_hello_names_the_side_channel_and_takes_earlier_lends_back(transfer):
    transfer.server.lend("r", [[3]])
    fields = plan_ops.hello_fields(transfer)
    assert fields == {"kv_transfer_address": transfer.server.address, "kv_transfer_identity": IDENTITY}
    assert transfer.server._lends == {}
    consumer = make_transfer(producer=False)
    try:
        assert plan_ops.hello_fields(consumer) == {"kv_transfer_address": "", "kv_transfer_identity": IDENTITY}
    finally:
        consumer.close()


def test_the_process_loop_watches_for_news_while_anything_is_lent(transfer):
    # A read of a lend frees the prefill engine's blocks: its news must not wait for the next heartbeat.
    assert not transfer.awaits_news
    transfer.server.lend("r", [[3]])
    assert transfer.awaits_news
    transfer.server.unlend(["r"])
    assert not transfer.awaits_news
