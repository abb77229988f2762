"""ExternalIO (worker/external/external_io.py) over a real DiskStore and real KV tensors:
a block saved then loaded into another device block is the same bits; a load stops at its
first missing or bad object and says how many blocks it loaded; a bad object goes from the
store with the load's blocks after it; a save the store refuses pauses saving."""

from __future__ import annotations

import threading

import pytest
import torch

from protocol.external_kv import HEADER_SIZE, object_key
from protocol.worker_messages import ExternalKVOps
from worker.external.disk_store import DiskStore
from worker.external.external_io import ExternalIO

IDENTITY = "ab" * 16
LAYERS, NUM_BLOCKS, BS, KVH, HD = 3, 12, 4, 2, 8
BOUND_S = 10.0  # every drain is bounded


def key(i: int) -> str:
    return object_key(IDENTITY, i.to_bytes(32, "big"))


def kv_caches(dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    # One per layer: (2, num_blocks, block_size, kv_heads, head_dim), K then V.
    return [torch.randn(2, NUM_BLOCKS, BS, KVH, HD, generator=g).to(dtype) for _ in range(LAYERS)]


def bits(kv: torch.Tensor, block_id: int) -> torch.Tensor:
    """One block of one layer, K and V, as raw bytes: (2, bs, kvh, hd * itemsize)."""
    return kv[:, block_id].contiguous().view(torch.uint8)


@pytest.fixture
def open_io(tmp_path):
    """ExternalIO over a DiskStore in tmp_path (``max_bytes``: its bound); every one is closed."""
    made: list[ExternalIO] = []

    def make(dtype=torch.bfloat16, max_bytes: int = 1 << 20) -> ExternalIO:
        io = ExternalIO(DiskStore(tmp_path, max_bytes, IDENTITY), IDENTITY, kv_caches(dtype))
        made.append(io)
        return io

    yield make
    for io in made:
        io.close()
        assert not io._thread.is_alive()


def run(io: ExternalIO, ops: ExternalKVOps) -> tuple[dict[int, int], list[str]] | None:
    """Stage, submit and wait for one plan's ops, as the worker's process loop does; its news."""
    io.submit(io.stage(ops), ops)
    assert io.drain(BOUND_S)
    return io.take_done()


def save(io: ExternalIO, block_ids: list[int], keys: list[str]):
    return run(io, ExternalKVOps(save_block_ids=block_ids, save_keys=keys))


def load(io: ExternalIO, load_id: int, keys: list[str], block_ids: list[int]):
    return run(io, ExternalKVOps(load_ids=[load_id], load_keys=[keys], load_block_ids=[block_ids]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=str)
def test_saved_blocks_load_into_other_blocks_bit_for_bit(open_io, dtype):
    io = open_io(dtype)
    kv = io.kv_caches
    assert io.block_bytes == LAYERS * 2 * BS * KVH * HD * torch.empty(0, dtype=dtype).element_size()
    assert save(io, [3, 5], [key(3), key(5)]) is None  # nothing to report: no load, nothing removed
    assert io.store.keys() == [key(3), key(5)]
    assert io.counters.saved_blocks == 2 and io.counters.saved_bytes == 2 * io.block_bytes
    before = [t.clone() for t in kv]
    assert not torch.equal(bits(kv[0], 3), bits(kv[0], 7))
    assert load(io, 42, [key(3), key(5)], [7, 9]) == ({42: 2}, [])
    for layer, t in enumerate(kv):
        assert torch.equal(bits(t, 7), bits(before[layer], 3)) and torch.equal(bits(t, 9), bits(before[layer], 5))
        for b in set(range(NUM_BLOCKS)) - {7, 9}:
            assert torch.equal(bits(t, b), bits(before[layer], b)), f"layer {layer} block {b} changed"
    assert io.counters.loaded_blocks == 2 and io.counters.load_failures == {} and not io.has_pending_loads
    assert io.take_done() is None  # reported once


def test_a_save_is_of_the_block_as_staged_before_the_plan_writes(open_io):
    io = open_io()
    kv = io.kv_caches
    old = [bits(t, 3).clone() for t in kv]
    ops = ExternalKVOps(save_block_ids=[3], save_keys=[key(3)])
    staged = io.stage(ops)
    for t in kv:  # the plan reuses block 3 and writes it
        t[:, 3] = 0
    io.submit(staged, ops)
    assert io.drain(BOUND_S)
    assert load(io, 1, [key(3)], [8]) == ({1: 1}, [])
    for layer, t in enumerate(kv):
        assert torch.equal(bits(t, 8), old[layer])


def test_a_load_stops_at_its_first_missing_block(open_io):
    io = open_io()
    kv = io.kv_caches
    save(io, [3, 5], [key(3), key(5)])
    before = [t.clone() for t in kv]
    done = load(io, 7, [key(3), key(4), key(5)], [7, 8, 9])
    # One block, from the first; the blocks after the miss go too, to be saved afresh once computed.
    assert done == ({7: 1}, [key(4), key(5)])
    assert io.store.keys() == [key(3)]
    for layer, t in enumerate(kv):
        assert torch.equal(bits(t, 7), bits(before[layer], 3))
        assert torch.equal(bits(t, 8), bits(before[layer], 8)) and torch.equal(bits(t, 9), bits(before[layer], 9))
    assert io.counters.load_failures == {"missing": 1} and io.counters.loaded_blocks == 1


@pytest.mark.parametrize(
    ("spoil", "reason"),
    [
        (lambda data: data[: HEADER_SIZE + 10] + bytes([data[HEADER_SIZE + 10] ^ 0xFF]) + data[HEADER_SIZE + 11 :], "checksum"),
        (lambda data: data[:-1], "truncated"),
    ],
    ids=["flipped-byte", "cut-short"],
)
def test_a_bad_object_loads_nothing_and_goes_with_the_blocks_after_it(open_io, spoil, reason):
    io = open_io()
    kv = io.kv_caches
    save(io, [2, 3, 5], [key(2), key(3), key(5)])
    f = io.store.dir / key(3)[:2] / f"{key(3)}.kv"
    f.write_bytes(spoil(f.read_bytes()))
    before = [t.clone() for t in kv]
    assert load(io, 9, [key(3), key(5)], [7, 9]) == ({9: 0}, [key(3), key(5)])
    assert io.counters.load_failures == {reason: 1} and io.counters.loaded_blocks == 0
    assert io.store.keys() == [key(2)] and not f.exists()
    for layer, t in enumerate(kv):
        assert torch.equal(t, before[layer])  # not one byte of a bad object is written


def test_a_refused_save_pauses_saving(open_io):
    io = open_io(max_bytes=100)  # smaller than one object
    assert io.block_bytes + HEADER_SIZE > 100 and not io.saving_paused
    assert save(io, [3, 5], [key(3), key(5)]) == ({}, [key(3), key(5)])
    assert io.saving_paused
    assert io.counters.save_failures == {"full": 1} and io.counters.saves_paused == 1 and io.counters.saved_blocks == 0
    assert save(io, [6], [key(6)]) == ({}, [key(6)])
    assert io.counters.save_failures == {"full": 1} and io.counters.saves_paused == 2  # one failure per pause, not per block
    assert io.store.keys() == [] and list(io.store.dir.rglob("*.kv")) == []


def test_loads_go_on_while_saving_is_paused(open_io):
    io = open_io()
    kv = io.kv_caches
    save(io, [3], [key(3)])
    io.store.max_bytes = 100  # the disk fills up: the next save is refused
    assert save(io, [5], [key(5)]) == ({}, [key(5)]) and io.saving_paused
    assert load(io, 4, [key(3)], [7]) == ({4: 1}, [])
    for t in kv:
        assert torch.equal(bits(t, 7), bits(t, 3))


def test_several_loads_of_one_plan_are_each_reported(open_io):
    io = open_io()
    save(io, [1, 2], [key(1), key(2)])
    ops = ExternalKVOps(load_ids=[10, 11], load_keys=[[key(1)], [key(2), key(9)]], load_block_ids=[[4], [5, 6]])
    staged = io.stage(ops)
    assert staged == []
    io.submit(staged, ops)
    assert io.drain(BOUND_S)
    loaded, removed = io.take_done()
    assert loaded == {10: 1, 11: 1} and removed == [key(9)] and not io.has_pending_loads


class GatedDiskStore(DiskStore):
    """A real DiskStore whose writes wait for ``gate``: a slow disk, to order the I/O thread's work."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.gate = threading.Event()
        self.writing = threading.Event()

    def put(self, key, header, payload):
        self.writing.set()
        assert self.gate.wait(BOUND_S), "the test never opened the gate"
        return super().put(key, header, payload)


def test_loads_go_before_queued_saves_and_read_a_save_still_queued(tmp_path):
    store = GatedDiskStore(tmp_path, 1 << 20, IDENTITY)
    io = ExternalIO(store, IDENTITY, kv_caches(torch.bfloat16))
    try:
        kv = io.kv_caches
        # Three saves: the thread blocks writing the first; the other two wait in the queue.
        io.submit(io.stage(ExternalKVOps(save_block_ids=[1, 2, 3], save_keys=[key(1), key(2), key(3)])), ExternalKVOps())
        assert store.writing.wait(BOUND_S)
        # A load of the third, queued after them, is served first, from the staged bytes.
        ops = ExternalKVOps(load_ids=[5], load_keys=[[key(3)]], load_block_ids=[[8]])
        io.submit([], ops)
        assert not io.drain(0.2)  # the first save still waits at the gate
        store.gate.set()
        assert io.drain(BOUND_S)
        assert io.take_done() == ({5: 1}, [])
        assert all(torch.equal(bits(layer, 8), bits(layer, 3)) for layer in kv)
        assert sorted(store.keys()) == sorted([key(1), key(2), key(3)])
    finally:
        store.gate.set()
        io.close()


def test_saves_past_the_pending_bound_are_dropped_and_reported(tmp_path):
    store = GatedDiskStore(tmp_path, 1 << 20, IDENTITY)
    io = ExternalIO(store, IDENTITY, kv_caches(torch.bfloat16), max_pending_save_bytes=2 * LAYERS * 2 * BS * KVH * HD * 2)
    try:
        staged = io.stage(ExternalKVOps(save_block_ids=[1, 2, 3, 4], save_keys=[key(1), key(2), key(3), key(4)]))
        io.submit(staged, ExternalKVOps())  # room for two blocks' bytes: the last two are dropped
        store.gate.set()
        assert io.drain(BOUND_S)
        assert io.counters.saves_dropped == 2 and io.counters.saved_blocks == 2
        assert io.take_done() == ({}, [key(3), key(4)])
        assert sorted(store.keys()) == sorted([key(1), key(2)])
    finally:
        store.gate.set()
        io.close()
