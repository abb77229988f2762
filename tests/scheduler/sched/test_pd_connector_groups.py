"""P/D disaggregation's connector for KV-cache groups (scheduler/sched/pd_connector.py,
pd_remote_blocks.py), unit by unit with hand-built tables and targets: a prefill engine
lends every group's blocks, a sliding group's nulls dropped and clipped to its in-window
tail (vLLM 0.32's ``remote_block_ids``: one list per group); a decode engine counts the
prompt by the full-attention group, refuses params it cannot read (by the key, the prompt
computed here), and maps each block to fill to the prefill's block at its position,
right-aligned per group. One group reads what it read before the lists were nested.

Block size 4; the hybrid engine has a full-attention group and a sliding group of window 8
(2 blocks). The prompt is 22 tokens: 6 blocks, the last of 2 tokens."""

from __future__ import annotations

import json
import logging

import pytest
from kvtest.fake_worker import FakeWorker, fake_sample

from protocol.kv_transfer_config import parse_kv_transfer_config
from protocol.kv_transfer_params import parse_kv_transfer_params
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.pd_connector import PDConnector
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 4
HYBRID = [0, 2 * BS]
PROMPT = list(range(2, 24))  # 22 tokens


def connector(role: str, group_windows=(0,)) -> PDConnector:
    config = parse_kv_transfer_config(json.dumps({"kv_connector": "KVPoolConnector", "kv_role": role, "engine_id": "e"}))
    pd = PDConnector(config, BS, group_windows=group_windows)
    pd.attach("127.0.0.1:7001")
    return pd


def decode_request(remote_block_ids, remote_num_tokens: int | None = len(PROMPT)) -> Request:
    r = Request("r", PROMPT, 4, seq_id=1)
    r.kv_transfer_params = parse_kv_transfer_params({
        "do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-r", "remote_host": "127.0.0.1",
        "remote_port": 7001, "remote_block_ids": remote_block_ids, "remote_num_tokens": remote_num_tokens})
    return r


def targets(*entries: tuple[int, int, int]) -> list[tuple[int, int, KVCacheBlock]]:
    """(group, position, block id) -> KVCacheManager.load_targets' triples."""
    return [(g, i, KVCacheBlock(b)) for g, i, b in entries]


# --- a prefill engine ---------------------------------------------------------------------


@pytest.mark.parametrize(("tables", "lent"), [
    # The sliding group's first entry null (out of the window already): dropped; its other 5
    # clipped to the last cdiv(8, 4) + 1 = 3.
    (([1, 2, 3, 4, 5, 6], [0, 7, 8, 9, 10, 11]), [[1, 2, 3, 4, 5, 6], [9, 10, 11]]),
    # Fewer than 3 left after the nulls: all of them.
    (([1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 10, 11]), [[1, 2, 3, 4, 5, 6], [10, 11]]),
    (([1, 2], [3, 4]), [[1, 2], [3, 4]]),
], ids=["clipped", "nulls", "short"])
def test_a_prefill_engine_lends_every_group_a_sliding_one_its_in_window_tail(tables, lent):
    pd = connector("kv_producer", HYBRID)
    r = Request("q", PROMPT, 1, seq_id=2)
    answer = pd.lend(r, tables)
    assert answer["remote_block_ids"] == lent
    assert pd.take_ops().lend_block_ids == [lent]  # the worker lets exactly these be read, group by group


def test_one_group_lends_its_table_as_one_list():
    pd = connector("kv_producer")
    answer = pd.lend(Request("q", PROMPT, 1, seq_id=2), ([3, 5, 7],))
    assert answer["remote_block_ids"] == [[3, 5, 7]]
    assert pd.take_ops().lend_block_ids == [[[3, 5, 7]]]


# --- a decode engine ----------------------------------------------------------------------

FULL = [11, 12, 13, 14, 15, 16]  # the prefill's full-attention table: positions 0..5
TAIL = [24, 25, 26]  # its sliding group's lent tail: positions 3..5


def test_the_full_group_gives_the_prompts_length():
    pd = connector("kv_consumer", HYBRID)
    r = decode_request([FULL, TAIL])
    assert pd.num_remote_tokens(r, 0) == 22 and pd.num_remote_tokens(r, 8) == 14
    # Capped by remote_num_tokens, as for one group.
    assert pd.num_remote_tokens(decode_request([FULL, TAIL], remote_num_tokens=21), 0) == 21


@pytest.mark.parametrize(("remote", "words"), [
    ([FULL], "kv_transfer_params.remote_block_ids names 1 KV-cache groups, this engine has 2"),
    ([FULL, TAIL, TAIL], "names 3 KV-cache groups, this engine has 2"),
    # Token 21, computed again here, attends to tokens 14..21: positions 3..5. 25 26 hold 4..5 only.
    ([FULL, [25, 26]], "kv_transfer_params.remote_block_ids[1]: 2 blocks do not cover the window of 8 tokens"),
], ids=["fewer-groups", "more-groups", "short-tail"])
def test_params_this_engine_cannot_read_are_refused_by_the_key_and_computed_here(caplog, remote, words):
    pd = connector("kv_consumer", HYBRID)
    r = decode_request(remote)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert pd.num_remote_tokens(r, 0) == 0
    assert words in caplog.text
    assert r.kv_transfer_params is None and pd.num_refused_pulls == 1  # refused once, never pulled
    assert pd.num_remote_tokens(r, 0) == 0 and pd.num_refused_pulls == 1


def test_a_one_group_engine_refuses_a_hybrid_prefills_params():
    pd = connector("kv_consumer")
    assert pd.num_remote_tokens(decode_request([FULL, TAIL]), 0) == 0 and pd.num_refused_pulls == 1


def test_a_hybrid_pull_reads_each_target_from_the_prefills_block_at_its_position():
    pd = connector("kv_consumer", HYBRID)
    r = decode_request([FULL, TAIL])
    # The decode engine's blocks: full attention 30..35 at positions 0..5; the sliding group
    # 40 41 42 at positions 3..5 (0..2 null: before the window), position by position.
    pd.add_pull(1, r, targets((0, 0, 30), (0, 1, 31), (0, 2, 32), (0, 3, 33), (1, 3, 40), (0, 4, 34), (1, 4, 41), (0, 5, 35),
                              (1, 5, 42)), 22)
    ops = pd.take_ops()
    assert ops.pull_remote_block_ids == [[[11, 12, 13, 14, 15, 16], [24, 25, 26]]]
    assert ops.pull_block_ids == [[30, 31, 32, 33, 34, 35, 40, 41, 42]]  # the same order: group by group
    assert ops.pull_request_ids == ["p-r"] and ops.pull_addresses == ["127.0.0.1:7001"]
    assert r.kv_transfer_params is None and (pd.num_pulls, pd.num_pull_blocks) == (1, 9)


def test_a_hybrid_pull_after_local_hits_reads_the_rest_of_each_group():
    pd = connector("kv_consumer", HYBRID)
    r = decode_request([FULL, TAIL])
    # 2 blocks hit on this engine: positions 2..5 pulled; the sliding group's 4 5 only
    # (its 3 a hit too, in this hand-built case).
    pd.add_pull(1, r, targets((0, 2, 32), (0, 3, 33), (0, 4, 34), (1, 4, 41), (0, 5, 35), (1, 5, 42)), 14)
    ops = pd.take_ops()
    assert ops.pull_remote_block_ids == [[[13, 14, 15, 16], [25, 26]]] and ops.pull_block_ids == [[32, 33, 34, 35, 41, 42]]


def test_a_target_the_prefill_did_not_lend_is_an_error_naming_it():
    pd = connector("kv_consumer", HYBRID)
    r = decode_request([FULL, TAIL])
    with pytest.raises(ValueError, match=r"group 1 at position 2 is not lent: the prefill engine lent positions 3\.\.5"):
        pd.add_pull(1, r, targets((0, 2, 32), (1, 2, 39), (0, 3, 33), (1, 3, 40)), 22)
    assert pd.take_ops() is None  # nothing planned


@pytest.mark.parametrize("remote", [[5, 6, 7, 8], [[5, 6, 7, 8]]], ids=["flat", "nested"])
def test_one_group_reads_the_same_blocks_as_before(remote):
    pd = connector("kv_consumer")
    r = Request("r", PROMPT[:14], 3, seq_id=1)
    r.kv_transfer_params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-r",
                                                     "remote_host": "h", "remote_port": 1, "remote_block_ids": remote})
    assert pd.num_remote_tokens(r, 0) == 14 and pd.num_remote_tokens(r, 8) == 6
    pd.add_pull(1, r, targets((0, 2, 20), (0, 3, 21)), 6)
    ops = pd.take_ops()
    assert ops.pull_remote_block_ids == [[[7, 8]]] and ops.pull_block_ids == [[20, 21]]
    r.kv_transfer_params = parse_kv_transfer_params({"do_remote_prefill": True, "remote_engine_id": "p", "remote_request_id": "p-r",
                                                     "remote_host": "h", "remote_port": 1, "remote_block_ids": remote})
    with pytest.raises(ValueError, match="group 0 at position 4 is not lent"):
        pd.add_pull(2, r, targets((0, 3, 21), (0, 4, 22)), 6)


# --- a hybrid prefill engine, with its scheduler and KV-cache manager ----------------------


def test_a_hybrid_prefill_engine_lends_its_request_s_groups_until_they_are_read():
    kv = KVCacheManager(40, BS, 64, True, group_windows=HYBRID)
    pd = connector("kv_producer", kv.group_windows)
    s = Scheduler(kv, 4, 64, 64, kv_transfer=pd)
    r = Request("r", PROMPT, 1, seq_id=1, ignore_eos=True, block_hasher=BlockHasher(BS))
    r.kv_transfer_params = parse_kv_transfer_params({"do_remote_decode": True})
    s.add_request(r)
    worker = FakeWorker(40, BS)
    out = s.schedule()
    free_before = kv.block_pool.get_num_free_blocks()
    s.update_from_output(worker.execute(out.plan))
    # The prompt in one step: 6 blocks in each group, none nulled yet (the window moves on the
    # next allocation). The sliding group lends its last 3: positions 3..5, the window of
    # token 21 (tokens 14..21) and one more.
    full, sliding = kv.get_block_ids("r")
    assert len(full) == len(sliding) == 6 and 0 not in sliding
    assert r.kv_transfer_answer["remote_block_ids"] == [full, sliding[3:]]
    assert r.kv_transfer_answer["remote_num_tokens"] == len(PROMPT)
    # Held (both groups), and the next plan tells the worker what may be read.
    assert kv.block_pool.get_num_free_blocks() == free_before and pd.lent.keys() == {"r"}
    assert s.schedule().plan.kv_transfer.lend_block_ids == [[full, sliding[3:]]]
    # The read frees every group's blocks.
    assert s.lends_read(["r"]) == 1 and kv.block_pool.get_num_free_blocks() == 40 - 1
    kv.check_invariants()


# --- a hybrid decode engine, with its scheduler and KV-cache manager -----------------------

# 23 tokens: the last (22) attends to tokens 15..22, and 15 is the last of block 3.
@pytest.mark.parametrize("length", [22, 23], ids=["22", "23-edge"])
def test_a_hybrid_decode_engine_pulls_every_block_the_window_of_the_last_prompt_token_needs(length):
    # The prefill engine's tables, lent as a hybrid prefill engine lends them.
    prompt = list(range(2, 2 + length))
    num_positions = -(-length // BS)
    full = list(range(1, num_positions + 1))
    sliding = list(range(21, 21 + num_positions))
    lent = pd_lend(full, sliding)
    kv = KVCacheManager(40, BS, 64, True, group_windows=HYBRID)
    pd = connector("kv_consumer", kv.group_windows)
    s = Scheduler(kv, 4, 64, 64, kv_transfer=pd)
    r = Request("r", prompt, 3, seq_id=1, ignore_eos=True, block_hasher=BlockHasher(BS))
    r.kv_transfer_params = decode_request(lent, length).kv_transfer_params
    s.add_request(r)
    ops = s.schedule().plan.kv_transfer
    (remote,), (local,) = ops.pull_remote_block_ids, ops.pull_block_ids
    # Every position of the full group; the sliding group's from the window of the last token
    # (computed again here: it attends to the 8 tokens ending with it) to the prompt's end.
    first = (length - 1 - HYBRID[1] + 1) // BS
    assert remote == [full, sliding[first:]]
    tables = kv.get_block_ids("r")
    assert local == tables[0] + tables[1][first:] and 0 not in tables[1][first:]
    kv.check_invariants()


def pd_lend(full: list[int], sliding: list[int]) -> list[list[int]]:
    return connector("kv_producer", HYBRID).lend(Request("q", PROMPT, 1, seq_id=9), (full, sliding))["remote_block_ids"]


def test_a_hybrid_pull_that_fails_under_recompute_gives_its_blocks_back_and_computes_the_prompt():
    # A sliding group's table holds nulls behind the window of the prompt's end: a failed pull
    # cannot resume from the device's hits with that table, so the request starts over.
    config = parse_kv_transfer_config(json.dumps({"kv_connector": "KVPoolConnector", "kv_role": "kv_consumer", "engine_id": "e",
                                                  "kv_load_failure_policy": "recompute"}))
    kv = KVCacheManager(40, BS, 64, True, group_windows=HYBRID)
    pd = PDConnector(config, BS, group_windows=kv.group_windows)
    pd.attach("127.0.0.1:7001")
    s = Scheduler(kv, 4, 64, 64, kv_transfer=pd)
    r = Request("r", PROMPT, 3, seq_id=1, ignore_eos=True, block_hasher=BlockHasher(BS))
    r.kv_transfer_params = decode_request(pd_lend(list(range(1, 7)), list(range(21, 27)))).kv_transfer_params
    s.add_request(r)
    worker = FakeWorker(40, BS)
    out = s.schedule()
    assert out.plan.kv_transfer.pull_ids == [1] and 0 in kv.get_block_ids("r")[1]  # parked, nulls behind the window
    s.update_from_output(worker.execute(out.plan))
    assert s.kv_pulls_done({1: 0}) == (1, [])
    # Back at the head of the queue with nothing: no block held, no token computed, the pull spent.
    assert kv.get_block_ids("r") == ([], []) and r.num_computed_tokens == 0 and r.kv_transfer_params is None
    assert pd.num_pull_failed_blocks == 6 + 3  # every target: the full group's 6, the window's 3
    kv.check_invariants()
    for _ in range(20):
        if not s.has_unfinished_requests():
            break
        out = s.schedule()
        # Whatever it computes has a block in every group: no null entry at a scheduled position.
        tables = kv.get_block_ids("r")
        assert all(t[i] for t in tables for i in range(r.num_computed_tokens // BS, len(t)))
        s.update_from_output(worker.execute(out.plan))
        kv.check_invariants()
    assert r.status.is_finished
    tokens = list(PROMPT)
    for _ in range(3):
        tokens.append(fake_sample(tokens, 512))
    assert r.output_token_ids == tokens[len(PROMPT):]


# --- a model of sliding-window layers only (one sliding group, window 8) -------------------


def test_sliding_groups_only_take_the_prompts_length_from_remote_num_tokens(caplog):
    pd = connector("kv_consumer", [2 * BS])
    # 22 tokens: 6 positions; the tail of 3 is positions 3..5, the window of token 21 (14..21) and one more.
    assert pd.num_remote_tokens(decode_request([TAIL]), 0) == 22
    # Without it, nothing gives the length: refused by the key, computed here.
    r = decode_request([TAIL], remote_num_tokens=None)
    with caplog.at_level(logging.WARNING, logger="scheduler"):
        assert pd.num_remote_tokens(r, 0) == 0
    assert "sliding-window groups only, and no kv_transfer_params.remote_num_tokens" in caplog.text
    assert r.kv_transfer_params is None and pd.num_refused_pulls == 1


def test_a_sliding_only_decode_engine_pulls_the_window_of_the_last_prompt_token():
    kv = KVCacheManager(40, BS, 64, True, group_windows=[2 * BS])
    pd = connector("kv_consumer", kv.group_windows)
    s = Scheduler(kv, 4, 64, 64, kv_transfer=pd)
    r = Request("r", PROMPT, 3, seq_id=1, ignore_eos=True, block_hasher=BlockHasher(BS))
    # The prefill's sliding group lent positions 3..5 as blocks 24, 25, 26.
    r.kv_transfer_params = decode_request([[24, 25, 26]]).kv_transfer_params
    s.add_request(r)
    worker = FakeWorker(40, BS)
    out = s.schedule()
    ops = out.plan.kv_transfer
    # Token 21, computed again here, attends to tokens 14..21: positions 3..5, all three read.
    (table,) = kv.get_block_ids("r")
    assert ops.pull_remote_block_ids == [[[24, 25, 26]]] and ops.pull_block_ids == [table[3:]]
    assert table[:3] == [0, 0, 0] and 0 not in table[3:]
    s.update_from_output(worker.execute(out.plan))
    assert s.kv_pulls_done({1: 3}) == (1, [])
    assert r.num_computed_tokens == 21  # the whole prompt but its last token, computed again
    kv.check_invariants()
