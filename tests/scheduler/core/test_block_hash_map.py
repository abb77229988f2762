"""BlockHashToBlockMap: hash -> one or several blocks (never de-duplicated).

A lookup returns the first block inserted under a hash; removing one block of a
hash keeps the others; ``pop`` reports "gone" only when the last one goes.
"""

from __future__ import annotations

from scheduler.core.block_hash_map import BlockHashToBlockMap
from scheduler.core.kv_cache_block import KVCacheBlock

H0, H1 = b"h0" * 16, b"h1" * 16


def blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def held(m: BlockHashToBlockMap, key: bytes) -> list[int]:
    return [b.block_id for k, b in m.items() if k == key]


def test_empty_map():
    m = BlockHashToBlockMap()
    assert m.get_one_block(H0) is None
    assert m.num_blocks(H0) == 0
    assert len(m) == 0 and H0 not in m
    assert list(m.items()) == []
    assert m.pop(H0, 1) == (None, False)
    assert len(m) == 0


def test_one_block_per_hash():
    b = blocks(3)
    m = BlockHashToBlockMap()
    assert m.insert(H0, b[1]) is True
    assert m.insert(H1, b[2]) is True
    assert m.get_one_block(H0) is b[1]
    assert m.get_one_block(H1) is b[2]
    assert m.num_blocks(H0) == 1 and len(m) == 2
    assert H0 in m and H1 in m
    assert sorted((k, v.block_id) for k, v in m.items()) == [(H0, 1), (H1, 2)]
    assert m.pop(H0, 1) == (b[1], True)
    assert m.get_one_block(H0) is None and H0 not in m
    assert m.get_one_block(H1) is b[2] and len(m) == 1


def test_several_blocks_per_hash_lookup_returns_the_first_inserted():
    b = blocks(6)
    m = BlockHashToBlockMap()
    assert m.insert(H0, b[4]) is True
    # A duplicate is kept, not merged: insert says the hash was not new.
    assert m.insert(H0, b[2]) is False
    assert m.insert(H0, b[5]) is False
    assert m.num_blocks(H0) == 3 and len(m) == 1
    assert m.get_one_block(H0) is b[4]
    assert held(m, H0) == [4, 2, 5]


def test_removing_one_of_several_keeps_the_others_and_is_not_gone():
    b = blocks(6)
    m = BlockHashToBlockMap()
    for i in (4, 2, 5):
        m.insert(H0, b[i])
    # Remove the first: the next in insertion order is now returned.
    assert m.pop(H0, 4) == (b[4], False)
    assert m.get_one_block(H0) is b[2]
    assert held(m, H0) == [2, 5] and m.num_blocks(H0) == 2
    # Remove the last of the remaining two: one left, stored bare again.
    assert m.pop(H0, 5) == (b[5], False)
    assert m.get_one_block(H0) is b[2] and m.num_blocks(H0) == 1
    assert held(m, H0) == [2]
    # Only now is the hash gone.
    assert m.pop(H0, 2) == (b[2], True)
    assert H0 not in m and m.get_one_block(H0) is None and len(m) == 0


def test_removing_a_middle_duplicate_keeps_order():
    b = blocks(6)
    m = BlockHashToBlockMap()
    for i in (1, 2, 3):
        m.insert(H0, b[i])
    assert m.pop(H0, 2) == (b[2], False)
    assert held(m, H0) == [1, 3] and m.get_one_block(H0) is b[1]


def test_reinsert_after_removal_goes_last():
    b = blocks(4)
    m = BlockHashToBlockMap()
    m.insert(H0, b[1])
    m.insert(H0, b[2])
    m.pop(H0, 1)
    assert m.insert(H0, b[3]) is False
    assert held(m, H0) == [2, 3] and m.get_one_block(H0) is b[2]


def test_pop_of_a_block_not_under_that_hash_changes_nothing():
    b = blocks(6)
    m = BlockHashToBlockMap()
    m.insert(H0, b[1])
    m.insert(H1, b[2])
    m.insert(H1, b[3])
    before = sorted((k, v.block_id) for k, v in m.items())
    # A single-block hash, another block id.
    assert m.pop(H0, 2) == (None, False)
    # A multi-block hash, another block id.
    assert m.pop(H1, 1) == (None, False)
    # A hash that is not there at all.
    assert m.pop(b"nope", 1) == (None, False)
    assert sorted((k, v.block_id) for k, v in m.items()) == before
    assert m.get_one_block(H0) is b[1] and m.get_one_block(H1) is b[2]
    assert held(m, H1) == [2, 3] and len(m) == 2


def test_clear_drops_everything():
    b = blocks(4)
    m = BlockHashToBlockMap()
    m.insert(H0, b[1])
    m.insert(H0, b[2])
    m.insert(H1, b[3])
    m.clear()
    assert len(m) == 0 and list(m.items()) == [] and m.get_one_block(H0) is None
    assert set(m.keys()) == set()
