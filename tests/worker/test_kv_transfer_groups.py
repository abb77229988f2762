"""P/D disaggregation's worker side for a hybrid model (several KV-cache groups) over real
ZMQ sockets and real KV tensors: a request is lent one list of blocks per group, a read
names one run of each group's lent list (or none of it) and gets them group after group,
bit for bit; a read of another group's blocks, out of order, not a run, of another
group count, or of nothing is refused and the lend kept. The KV tensors are shared as a
hybrid worker's are (tensor j holds the j-th layer of every group), so a block moves
whatever group lent it."""

from __future__ import annotations

import pytest
import torch

from worker.kv.kv_block_bytes import block_bytes
from worker.transfer.kv_puller import KVPuller, Pull
from worker.transfer.kv_server import KVServer, is_lent_run

IDENTITY = "ef" * 16
NUM_BLOCKS, BS, KVH, HD = 16, 4, 2, 8
BOUND_S = 10.0


def hybrid_kv_caches(seed: int) -> list[torch.Tensor]:
    """One entry per layer of a model of two groups of two layers each: layers 0 and 2 (one
    of each group) share tensor 0, layers 1 and 3 tensor 1. (2, blocks, bs, kvh, hd) each."""
    g = torch.Generator().manual_seed(seed)
    shared = [torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g).to(torch.bfloat16) for _ in range(2)]
    return [shared[0], shared[1], shared[0], shared[1]]


def same_blocks(src: list[torch.Tensor], src_ids: list[int], dst: list[torch.Tensor], dst_ids: list[int]) -> bool:
    return all(torch.equal(s[:, a], d[:, b]) for s, d in zip(src, dst, strict=True) for a, b in zip(src_ids, dst_ids, strict=True))


@pytest.fixture
def pair():
    server = KVServer(hybrid_kv_caches(1), IDENTITY, "127.0.0.1", 0, lend_wait_s=0.3)
    puller = KVPuller(hybrid_kv_caches(2), IDENTITY, BOUND_S)
    yield server, puller
    for part in (server, puller):
        part.close()
        assert not part._thread.is_alive()


def pull(puller: KVPuller, address: str, request_id: str, remote: list[list[int]], local: list[int], pull_id: int = 1) -> dict[int, int]:
    puller.submit([Pull(pull_id, address, request_id, remote, local)])
    assert puller.drain(BOUND_S)
    return puller.take_pulled()


# A request of a full-attention group (its table: 3 5 7 9) and a sliding group (its
# in-window tail: 8 10, the entries before it null and not lent).
LENT = [[3, 5, 7, 9], [8, 10]]


@pytest.mark.parametrize(("remote", "local"), [
    ([[3, 5, 7, 9], [8, 10]], [1, 2, 4, 6, 11, 12]),  # everything lent
    ([[7, 9], [10]], [1, 2, 11]),  # after the reader's own hits: a run of each group
    ([[5, 7, 9], []], [2, 4, 6]),  # nothing of a group
], ids=["all", "runs", "one-group"])
def test_a_read_of_a_run_of_each_groups_lent_blocks_moves_them_group_after_group(pair, remote, local):
    server, puller = pair
    before = [t.clone() for t in puller.kv_caches]
    server.lend("req-1", LENT)
    flat = [b for group in remote for b in group]
    assert pull(puller, server.address, "req-1", remote, local) == {1: len(flat)}
    assert same_blocks(server.kv_caches, flat, puller.kv_caches, local)
    others = [b for b in range(NUM_BLOCKS) if b not in local]
    assert same_blocks(before, others, puller.kv_caches, others)  # nothing else written
    assert server.take_sent() == ["req-1"]
    assert server.counters.served_bytes == len(flat) * block_bytes(server.kv_caches)


@pytest.mark.parametrize("remote", [
    [[3, 5, 7, 9]],  # one group named, two lent
    [[3, 5], [8], [10]],  # three groups named
    [[3, 5], [9]],  # 9 is lent, by the full group: not the sliding group's
    [[3, 5], [10, 8]],  # out of order
    [[3, 7], [8]],  # not a run
    [[5, 5], [8]],  # twice
    [[], []],  # nothing
    [[3], [12]],  # never lent
], ids=["fewer-groups", "more-groups", "other-group", "order", "gap", "twice", "empty", "not-lent"])
def test_any_other_read_is_refused_and_the_lend_kept(pair, remote):
    server, puller = pair
    server.lend("req-1", LENT)
    n = sum(len(g) for g in remote)
    assert pull(puller, server.address, "req-1", remote, list(range(1, n + 1))) == {1: 0}
    assert server.counters.refusals == {"blocks": 1} and server.take_sent() == []
    assert pull(puller, server.address, "req-1", LENT, [1, 2, 4, 6, 11, 12], pull_id=2) == {2: 6}


def test_is_lent_run_for_one_group_is_the_old_rule():
    lent = [[3, 5, 7]]
    assert is_lent_run([[3, 5, 7]], lent) and is_lent_run([[5, 7]], lent) and is_lent_run([[5]], lent)
    assert not any(is_lent_run(asked, lent) for asked in ([[5, 3]], [[3, 7]], [[5, 5]], [[3, 3, 5]], [[]], [], [[3], []]))
