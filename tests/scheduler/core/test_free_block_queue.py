"""FreeKVCacheBlockQueue: the doubly linked list threaded through the blocks.

Every test checks, after each operation, that the links agree both ways, that
the sentinels are where they should be and that ``num_free_blocks`` counts what
is linked. The queue state is drawn in comments, front (reused first) on the left.
"""

from __future__ import annotations

import pytest

from scheduler.core.free_block_queue import FreeKVCacheBlockQueue
from scheduler.core.kv_cache_block import KVCacheBlock


def make(n: int) -> tuple[list[KVCacheBlock], FreeKVCacheBlockQueue]:
    blocks = [KVCacheBlock(i) for i in range(n)]
    return blocks, FreeKVCacheBlockQueue(blocks)


def ids(queue: FreeKVCacheBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def check_links(queue: FreeKVCacheBlockQueue, blocks: list[KVCacheBlock]) -> None:
    """Walk head -> tail and tail -> head; both walks must agree, every block
    outside the queue must be unlinked, and the count must match."""
    head, tail = queue.fake_free_list_head, queue.fake_free_list_tail
    assert head.block_id == -1 and tail.block_id == -1
    assert head.prev_free_block is None and tail.next_free_block is None
    forward = []
    prev, block = head, head.next_free_block
    while block is not tail:
        assert block is not None, "forward walk fell off the list"
        assert block.prev_free_block is prev, f"block {block.block_id}: prev link disagrees"
        forward.append(block)
        assert len(forward) <= len(blocks), "cycle in the free list"
        prev, block = block, block.next_free_block
    assert tail.prev_free_block is prev
    backward = []
    nxt, block = tail, tail.prev_free_block
    while block is not head:
        assert block is not None, "backward walk fell off the list"
        assert block.next_free_block is nxt, f"block {block.block_id}: next link disagrees"
        backward.append(block)
        assert len(backward) <= len(blocks), "cycle in the free list"
        nxt, block = block, block.prev_free_block
    assert backward[::-1] == forward
    assert len(forward) == len({id(b) for b in forward}), "a block is linked twice"
    assert queue.num_free_blocks == len(forward) == len(queue)
    assert list(queue) == forward
    linked = {id(b) for b in forward}
    for b in blocks:
        if id(b) not in linked:
            assert b.prev_free_block is None and b.next_free_block is None, f"block {b.block_id} is out but linked"


def test_new_queue_holds_every_block_in_order():
    blocks, q = make(5)
    # head -> 0 -> 1 -> 2 -> 3 -> 4 -> tail
    assert ids(q) == [0, 1, 2, 3, 4]
    assert q.num_free_blocks == 5
    check_links(q, blocks)


def test_empty_queue_links_head_to_tail():
    q = FreeKVCacheBlockQueue([])
    # head -> tail
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert q.fake_free_list_tail.prev_free_block is q.fake_free_list_head
    assert ids(q) == [] and q.num_free_blocks == 0
    check_links(q, [])


def test_popleft_takes_the_front_until_empty_then_raises():
    blocks, q = make(3)
    # head -> 0 -> 1 -> 2 -> tail
    assert q.popleft() is blocks[0]
    # head -> 1 -> 2 -> tail
    assert ids(q) == [1, 2]
    check_links(q, blocks)
    assert q.popleft() is blocks[1]
    assert q.popleft() is blocks[2]
    # head -> tail
    assert ids(q) == [] and q.num_free_blocks == 0
    check_links(q, blocks)
    with pytest.raises(ValueError):
        q.popleft()
    # Still empty and intact after the failed pop.
    assert q.num_free_blocks == 0
    check_links(q, blocks)


def test_popleft_on_a_queue_made_empty():
    q = FreeKVCacheBlockQueue([])
    with pytest.raises(ValueError):
        q.popleft()
    check_links(q, [])


def test_popleft_n_takes_front_blocks_front_first():
    blocks, q = make(6)
    # head -> 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> tail
    got = q.popleft_n(4)
    assert [b.block_id for b in got] == [0, 1, 2, 3]
    # head -> 4 -> 5 -> tail
    assert ids(q) == [4, 5]
    check_links(q, blocks)
    assert q.popleft_n(0) == []
    assert ids(q) == [4, 5]
    check_links(q, blocks)
    # Exactly all of them.
    assert [b.block_id for b in q.popleft_n(2)] == [4, 5]
    # head -> tail
    check_links(q, blocks)


def test_popleft_n_more_than_free_raises_and_changes_nothing():
    blocks, q = make(4)
    q.remove(blocks[1])
    # head -> 0 -> 2 -> 3 -> tail
    with pytest.raises(ValueError):
        q.popleft_n(4)
    assert ids(q) == [0, 2, 3]
    check_links(q, blocks)
    q.popleft_n(3)
    # head -> tail
    with pytest.raises(ValueError):
        q.popleft_n(1)
    assert q.num_free_blocks == 0
    check_links(q, blocks)


def test_popleft_n_negative_raises_and_changes_nothing():
    blocks, q = make(3)
    with pytest.raises(ValueError):
        q.popleft_n(-1)
    assert ids(q) == [0, 1, 2] and q.num_free_blocks == 3
    check_links(q, blocks)


def test_remove_first_middle_last_and_only():
    blocks, q = make(5)
    # head -> 0 -> 1 -> 2 -> 3 -> 4 -> tail
    q.remove(blocks[0])
    # head -> 1 -> 2 -> 3 -> 4 -> tail
    assert ids(q) == [1, 2, 3, 4]
    check_links(q, blocks)
    q.remove(blocks[4])
    # head -> 1 -> 2 -> 3 -> tail
    assert ids(q) == [1, 2, 3]
    check_links(q, blocks)
    q.remove(blocks[2])
    # head -> 1 -> 3 -> tail
    assert ids(q) == [1, 3]
    check_links(q, blocks)
    q.remove(blocks[1])
    # head -> 3 -> tail
    q.remove(blocks[3])
    # head -> tail
    assert ids(q) == [] and q.num_free_blocks == 0
    check_links(q, blocks)


def test_remove_a_block_not_in_the_queue_raises():
    blocks, q = make(3)
    q.remove(blocks[1])
    # head -> 0 -> 2 -> tail
    with pytest.raises(RuntimeError):
        q.remove(blocks[1])
    assert ids(q) == [0, 2]
    check_links(q, blocks)


def test_append_puts_blocks_at_the_back():
    blocks, q = make(4)
    taken = q.popleft_n(3)
    # head -> 3 -> tail
    q.append(taken[1])
    # head -> 3 -> 1 -> tail
    assert ids(q) == [3, 1]
    check_links(q, blocks)
    q.append(taken[0])
    # head -> 3 -> 1 -> 0 -> tail
    assert ids(q) == [3, 1, 0]
    check_links(q, blocks)


def test_append_to_an_empty_queue():
    blocks, q = make(2)
    a, b = q.popleft_n(2)
    # head -> tail
    q.append(b)
    # head -> 1 -> tail
    assert ids(q) == [1]
    check_links(q, blocks)
    q.append(a)
    # head -> 1 -> 0 -> tail
    assert ids(q) == [1, 0]
    check_links(q, blocks)


def test_append_n_keeps_the_given_order_at_the_back():
    blocks, q = make(8)
    taken = q.popleft_n(5)
    # head -> 5 -> 6 -> 7 -> tail
    q.append_n([taken[4], taken[2], taken[0]])
    # head -> 5 -> 6 -> 7 -> 4 -> 2 -> 0 -> tail
    assert ids(q) == [5, 6, 7, 4, 2, 0]
    check_links(q, blocks)
    q.append_n([])
    assert ids(q) == [5, 6, 7, 4, 2, 0]
    check_links(q, blocks)
    q.popleft_n(6)
    # head -> tail
    q.append_n([taken[3], taken[1]])
    # head -> 3 -> 1 -> tail
    assert ids(q) == [3, 1]
    check_links(q, blocks)


def test_append_n_onto_a_broken_tail_asserts_and_changes_nothing():
    blocks, q = make(0)
    spare = KVCacheBlock(9)
    q.fake_free_list_tail.prev_free_block = None
    with pytest.raises(AssertionError):
        q.append_n([spare])
    assert q.num_free_blocks == 0
    assert q.fake_free_list_head.next_free_block is q.fake_free_list_tail
    assert spare.prev_free_block is None and spare.next_free_block is None


def test_prepend_n_keeps_the_given_order_at_the_front():
    blocks, q = make(8)
    taken = q.popleft_n(5)
    # head -> 5 -> 6 -> 7 -> tail
    q.prepend_n([taken[4], taken[2], taken[0]])
    # head -> 4 -> 2 -> 0 -> 5 -> 6 -> 7 -> tail
    assert ids(q) == [4, 2, 0, 5, 6, 7]
    check_links(q, blocks)
    q.prepend_n([])
    assert ids(q) == [4, 2, 0, 5, 6, 7]
    q.popleft_n(6)
    # head -> tail
    q.prepend_n([taken[3], taken[1]])
    # head -> 3 -> 1 -> tail
    assert ids(q) == [3, 1]
    assert q.get_all_free_blocks() == [taken[3], taken[1]]
    check_links(q, blocks)


def test_a_block_hash_is_set_once_and_reset():
    block = KVCacheBlock(1)
    block.set_block_hash(b"h")
    assert block.block_hash == b"h"
    with pytest.raises(AssertionError):
        block.set_block_hash(b"g")
    block.reset_hash()
    assert block.block_hash is None


def _owned(*blocks):
    for b in blocks:
        b.ref_cnt = 1
    return list(blocks)


def test_release_sends_unhashed_blocks_to_the_front_and_hashed_to_the_back_in_order():
    blocks, q = make(8)
    taken = q.popleft_n(5)
    # head -> 5 -> 6 -> 7 -> tail; each block taken has its first owner
    assert [b.ref_cnt for b in blocks] == [1] * 5 + [0] * 3
    taken[1].block_hash = b"h1"
    taken[3].block_hash = b"h3"
    assert q.release(_owned(taken[4], taken[3], taken[2], taken[1], taken[0])) == 2
    # unhashed 4, 2, 0 at the front (the first given reused first), hashed 3, 1 at the back
    assert ids(q) == [4, 2, 0, 5, 6, 7, 3, 1]
    assert len(q) == 8 and all(b.ref_cnt == 0 for b in blocks)
    check_links(q, blocks)
    assert q.release([]) == 0
    assert ids(q) == [4, 2, 0, 5, 6, 7, 3, 1]
    q.popleft_n(8)
    # An empty queue: both ends are linked through the sentinels.
    assert q.release(_owned(taken[3], taken[4])) == 1
    assert ids(q) == [4, 3]
    check_links(q, blocks)


def test_release_keeps_blocks_that_still_have_an_owner_and_the_null_block_out():
    blocks, q = make(4)
    taken = q.popleft_n(3)
    taken[0].ref_cnt = 2  # shared by two requests
    taken[1].ref_cnt = 1
    taken[2].ref_cnt = 1
    taken[2].is_null = True
    assert q.release(taken) == 0
    assert ids(q) == [1, 3]
    assert [b.ref_cnt for b in taken] == [1, 0, 0]
    check_links(q, blocks[1:])


def test_acquire_takes_free_blocks_out_wherever_they_are_and_counts_owners():
    blocks, q = make(6)
    held = q.popleft_n(1)[0]  # block 0, owned elsewhere
    held.ref_cnt = 1
    # head -> 1 -> 2 -> 3 -> 4 -> 5 -> tail
    assert q.acquire([blocks[3], held, blocks[5], blocks[1]]) == 3
    assert ids(q) == [2, 4]
    assert len(q) == 2
    assert [b.ref_cnt for b in blocks] == [2, 1, 0, 1, 0, 1]
    check_links(q, [b for b in blocks if b.ref_cnt == 0])
    # A block with no owner that is not in the queue is a broken pool: said, and
    # the count still matches the list.
    blocks[3].ref_cnt = 0
    with pytest.raises(RuntimeError, match="block 3 is not in the free queue"):
        q.acquire([blocks[2], blocks[3]])
    assert len(q) == len(ids(q)) == 1


def test_mixed_operations_keep_links_consistent():
    blocks, q = make(10)
    # head -> 0 -> 1 -> 2 -> 3 -> 4 -> 5 -> 6 -> 7 -> 8 -> 9 -> tail
    a = q.popleft_n(4)  # 0 1 2 3 out
    # head -> 4 -> 5 -> 6 -> 7 -> 8 -> 9 -> tail
    q.remove(blocks[7])
    # head -> 4 -> 5 -> 6 -> 8 -> 9 -> tail
    q.append_n([a[3], a[2]])
    # head -> 4 -> 5 -> 6 -> 8 -> 9 -> 3 -> 2 -> tail
    q.release(_owned(a[1]))  # unhashed: to the front
    # head -> 1 -> 4 -> 5 -> 6 -> 8 -> 9 -> 3 -> 2 -> tail
    q.append(blocks[7])
    # head -> 1 -> 4 -> 5 -> 6 -> 8 -> 9 -> 3 -> 2 -> 7 -> tail
    assert ids(q) == [1, 4, 5, 6, 8, 9, 3, 2, 7]
    check_links(q, blocks)
    q.remove(blocks[7])  # the last
    q.remove(blocks[1])  # the first
    q.remove(blocks[9])  # a middle one
    # head -> 4 -> 5 -> 6 -> 8 -> 3 -> 2 -> tail
    assert ids(q) == [4, 5, 6, 8, 3, 2]
    check_links(q, blocks)
    assert [b.block_id for b in q.popleft_n(6)] == [4, 5, 6, 8, 3, 2]
    # head -> tail
    check_links(q, blocks)


def test_random_operations_match_a_list():
    import random

    rng = random.Random(1234)
    blocks, q = make(30)
    model = [b.block_id for b in blocks]
    for _ in range(2000):
        out = [b for b in blocks if b.block_id not in set(model)]
        op = rng.randrange(6)
        if op == 0 and model:
            assert q.popleft().block_id == model.pop(0)
        elif op == 1:
            n = rng.randrange(len(model) + 1)
            assert [b.block_id for b in q.popleft_n(n)] == model[:n]
            del model[:n]
        elif op == 2 and model:
            victim = rng.choice(model)
            q.remove(blocks[victim])
            model.remove(victim)
        elif op == 3 and out:
            b = rng.choice(out)
            q.append(b)
            model.append(b.block_id)
        elif op == 4 and out:
            chosen = rng.sample(out, rng.randrange(len(out) + 1))
            q.append_n(chosen)
            model.extend(b.block_id for b in chosen)
        elif op == 5 and out:
            chosen = rng.sample(out, rng.randrange(len(out) + 1))
            q.release(_owned(*chosen))  # unhashed blocks: to the front, in order
            model[:0] = [b.block_id for b in chosen]
        assert ids(q) == model
        check_links(q, blocks)
