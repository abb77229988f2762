"""check_external_ops (worker/external/ops_check.py): a plan's external saves and loads are
refused whole (PlanError, before anything of the plan is applied) unless the worker has a
tier and every list is well formed."""

from __future__ import annotations

import pytest
import torch

from protocol.worker_messages import ExternalKVOps
from worker.external.disk_store import DiskStore
from worker.external.external_io import ExternalIO
from worker.external.ops_check import check_external_ops
from worker.step.plan_check import PlanError

NUM_BLOCKS = 10
K = [f"{i:040x}" for i in range(8)]


@pytest.fixture
def external(tmp_path):
    io = ExternalIO(DiskStore(tmp_path, 1 << 20, "ab" * 16), "ab" * 16, [torch.zeros(2, NUM_BLOCKS, 4, 1, 8)])
    yield io
    io.close()


GOOD = ExternalKVOps(save_block_ids=[1, 9], save_keys=[K[0], K[1]], load_ids=[5, 6], load_keys=[[K[2], K[3]], [K[4]]],
                     load_block_ids=[[2, 3], [4]])


def test_good_ops_pass(external):
    check_external_ops(GOOD, external, NUM_BLOCKS)
    check_external_ops(ExternalKVOps(), external, NUM_BLOCKS)
    # A block saved and loaded in one plan is fine: the save reads it before the load writes it.
    check_external_ops(ExternalKVOps(save_block_ids=[2], save_keys=[K[0]], load_ids=[1], load_keys=[[K[1]]], load_block_ids=[[2]]), external, NUM_BLOCKS)


def test_a_worker_without_a_tier_refuses_any_ops():
    with pytest.raises(PlanError, match="no external tier"):
        check_external_ops(GOOD, None, NUM_BLOCKS)


@pytest.mark.parametrize(
    ("ops", "words"),
    [
        (ExternalKVOps(save_block_ids=[1, 2], save_keys=[K[0]]), "external saves: 2 blocks for 1 keys"),
        (ExternalKVOps(load_ids=[1, 2], load_keys=[[K[0]]], load_block_ids=[[1]]), "2 ids, 1 key lists, 1 block lists"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0]]], load_block_ids=[[1], [2]]), "1 ids, 1 key lists, 2 block lists"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0], K[1]]], load_block_ids=[[1]]), "external load 1: 2 keys for 1 blocks"),
        (ExternalKVOps(load_ids=[3, 3], load_keys=[[K[0]], [K[1]]], load_block_ids=[[1], [2]]), "an id repeats"),
        (ExternalKVOps(load_ids=[1], load_keys=[[]], load_block_ids=[[]]), "external load 1: 0 keys for 0 blocks"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0]]], load_block_ids=[[0]]), "external load 1: block id 0 is outside 1..9"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0]]], load_block_ids=[[NUM_BLOCKS]]), "block id 10 is outside 1..9"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0]]], load_block_ids=[[-1]]), "block id -1 is outside 1..9"),
        (ExternalKVOps(save_block_ids=[0], save_keys=[K[0]]), "external saves: block id 0 is outside 1..9"),
        (ExternalKVOps(save_block_ids=[NUM_BLOCKS], save_keys=[K[0]]), "external saves: block id 10 is outside 1..9"),
        (ExternalKVOps(load_ids=[1], load_keys=[[K[0], K[1]]], load_block_ids=[[4, 4]]), "a device block is loaded twice"),
        (ExternalKVOps(load_ids=[1, 2], load_keys=[[K[0]], [K[1]]], load_block_ids=[[4], [4]]), "a device block is loaded twice"),
    ],
    ids=["save-lengths", "load-ids", "load-block-lists", "keys-vs-blocks", "duplicate-id", "no-keys", "null-block", "past-the-pool",
         "negative", "save-null-block", "save-past-the-pool", "twice-in-a-load", "twice-across-loads"],
)
def test_malformed_ops_are_refused(external, ops, words):
    with pytest.raises(PlanError) as e:
        check_external_ops(ops, external, NUM_BLOCKS)
    assert words in str(e.value)
