"""cache_salt isolates tenants: requests with different salts never share a KV block,
requests without a salt (or with the empty salt, which hashes as none) do.

In-process: the block tables of two running requests with the same prompt are
disjoint when their salts differ and share the prefix when they do not. End to end:
the num_cached_tokens every TokenOutput reports, over real sockets.
"""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster
from kvtest.fake_worker import FakeWorker

from protocol.client_messages import Generate
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

pytestmark = pytest.mark.timeout(120)

BLOCK = 16
PROMPT = [random.Random(5).randrange(2, 500) for _ in range(4 * BLOCK)]
# 64 prompt tokens: at most 3 full blocks hit, the last prompt token is always computed.
FULL_HIT = 3 * BLOCK


def admit_both(salt_a: str | None, salt_b: str | None) -> tuple[list[int], list[int], KVCacheManager]:
    """Admit request a, then (a step later, once a's full blocks are cached) request b
    with the same prompt; both are running when this returns."""
    hasher = BlockHasher(BLOCK)
    kv = KVCacheManager(64, BLOCK, 1024)
    sched = Scheduler(kv, 8, 4096, 1024)
    worker = FakeWorker(64, BLOCK)
    a = Request("a", list(PROMPT), 8, seq_id=0, cache_salt=salt_a, block_hasher=hasher)
    b = Request("b", list(PROMPT), 8, seq_id=1, cache_salt=salt_b, block_hasher=hasher)
    for request in (a, b):
        sched.add_request(request)
        sched.update_from_output(worker.execute(sched.schedule().plan))
    assert sched.running == [a, b]
    kv.check_invariants()
    return kv.get_block_ids("a")[0], kv.get_block_ids("b")[0], kv


def test_two_salts_never_share_a_block_while_both_run():
    blocks_a, blocks_b, kv = admit_both("tenant-a", "tenant-b")
    # a has decoded one token (65 tokens: 5 blocks); b has just been admitted (4 blocks).
    assert (len(blocks_a), len(blocks_b)) == (5, 4)
    assert not set(blocks_a) & set(blocks_b)
    assert all(kv.block_pool.blocks[i].ref_cnt == 1 for i in blocks_a + blocks_b)


@pytest.mark.parametrize("salt", [None, "", "tenant-a"])
def test_the_same_salt_or_none_shares_the_prefix(salt):
    blocks_a, blocks_b, kv = admit_both(salt, salt)
    assert blocks_a[:3] == blocks_b[:3]
    assert all(kv.block_pool.blocks[i].ref_cnt == 2 for i in blocks_a[:3])
    assert not set(blocks_a[3:]) & set(blocks_b[3:])


def test_a_salt_and_no_salt_never_share_a_block():
    blocks_a, blocks_b, _ = admit_both("tenant-a", None)
    assert not set(blocks_a) & set(blocks_b)


def test_salt_hashing_empty_is_none_and_salts_differ_from_the_first_block():
    h = BlockHasher(BLOCK)
    none, empty, a, b = (h.block_hashes(PROMPT, s) for s in (None, "", "tenant-a", "tenant-b"))
    assert none == empty
    assert len({none[0], a[0], b[0]}) == 3
    # The salt enters the first block only, but the chain carries it into every block.
    assert not set(none) & set(a) and not set(a) & set(b)


@pytest.mark.e2e
def test_cached_tokens_over_the_wire_follow_the_salt(tmp_path):
    def run(c, rid, salt):
        r = c.generate([Generate(rid, PROMPT, 4, ignore_eos=True, cache_salt=salt)], timeout=60)[rid]
        assert r.error is None and r.finish_reason == "length", r
        return r

    with Cluster([], log_dir=tmp_path) as c:
        a1 = run(c, "a1", "tenant-a")
        a2 = run(c, "a2", "tenant-a")
        b1 = run(c, "b1", "tenant-b")
        n1 = run(c, "n1", None)
        n2 = run(c, "n2", None)
        e1 = run(c, "e1", "")
        a3 = run(c, "a3", "tenant-a")
        m = c.metrics()
    assert [r.num_cached_tokens for r in (a1, a2, b1, n1, n2, e1, a3)] == [0, FULL_HIT, 0, 0, FULL_HIT, FULL_HIT, FULL_HIT]
    # The salt changes what is shared, never what is generated.
    assert a1.token_ids == a2.token_ids == b1.token_ids == n1.token_ids == e1.token_ids
    assert m["vllm:prefix_cache_hits_total"] == 4 * FULL_HIT
    assert m["vllm:kv_cache_usage_perc"] == 0.0
