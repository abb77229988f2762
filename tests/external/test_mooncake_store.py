"""MooncakeStore (the worker's side) and MooncakeKeyIndex (the scheduler's) against a real
``mooncake_master`` on loopback: objects round-trip whole, the index sees what the store
holds and what is in flight, and a master that is gone or never was fails fast."""

from __future__ import annotations

import logging
import os
import socket
import time

import pytest
from kvtest.ports import free_port

from protocol.external_kv import decode, encode_header, kv_identity, object_key
from scheduler.core.offload.mooncake_index import MooncakeKeyIndex
from worker.external.mooncake_store import READ_BUFFER_BYTES, MooncakeStore
from worker.external.store_errors import StoreError

IDENTITY = kv_identity("LlamaForCausalLM", "test", "bfloat16", 16, 2, 2, 8)
SMALL = 4096

_counter = iter(range(1 << 30))


def new_keys(n: int) -> list[str]:
    """Keys no other test of the module has used (the store outlives each test)."""
    return [object_key(IDENTITY, next(_counter).to_bytes(32, "little")) for _ in range(n)]


def put_object(store: MooncakeStore, key: str, size: int = SMALL) -> bytes:
    """Put an object of ``size`` random payload bytes; returns it whole (header + payload)."""
    payload = os.urandom(size)
    header = encode_header(IDENTITY, key, payload)
    assert store.put(key, header, memoryview(payload)) == []
    return header + payload


@pytest.fixture(scope="module")
def store(mooncake_master):
    # Lends no memory (the default): the objects go to the store server.
    s = MooncakeStore(mooncake_master.master_address, mooncake_master.metadata_server, local_buffer_bytes=8 << 20)
    yield s
    s.close()


@pytest.fixture(scope="module")
def index(mooncake_master):
    ix = MooncakeKeyIndex(mooncake_master.master_address, mooncake_master.metadata_server)
    yield ix
    ix.close()


def test_a_1_mib_object_round_trips_whole(store):
    (key,) = new_keys(1)
    # Bigger than the first read buffer: the get grows it.
    obj = put_object(store, key, 1 << 20)
    assert len(obj) > READ_BUFFER_BYTES
    got = store.get(key)
    assert got == obj
    assert bytes(decode(got, IDENTITY, key, 1 << 20)) == obj[-(1 << 20) :]
    # A second put of a key already held is the same object: accepted, nothing changes.
    assert store.put(key, obj[:64], obj[64:]) == []
    assert store.get(key) == obj


def test_objects_outlive_the_client_that_wrote_them(mooncake_master, store):
    (key,) = new_keys(1)
    writer = MooncakeStore(mooncake_master.master_address, mooncake_master.metadata_server, local_buffer_bytes=1 << 20)
    try:
        obj = put_object(writer, key)
    finally:
        writer.close()
    assert store.get(key) == obj


def test_a_missing_key_reads_as_none(store):
    (key,) = new_keys(1)
    assert store.get(key) is None
    assert key not in store
    assert store.keys() == []


def test_an_object_larger_than_the_local_buffer_is_refused_as_full(store):
    (key,) = new_keys(1)
    with pytest.raises(StoreError) as e:
        store.put(key, b"h" * 64, bytes(8 << 20))
    assert e.value.reason == "full"
    assert store.get(key) is None


def test_the_index_sees_what_the_store_holds(store, index):
    k0, k1, k2, k3 = new_keys(4)
    put_object(store, k0)
    put_object(store, k1)
    put_object(store, k3)
    assert k0 in store and k2 not in store
    # held: k0 k1 . k3 -- the prefix stops at the first key not held
    assert index.count_prefix([k0, k1, k2, k3]) == 2
    assert index.count_prefix([k2, k0]) == 0
    assert index.count_prefix([]) == 0
    assert index.missing([k0, k1, k2, k3]) == [False, False, True, False]
    assert index.missing([]) == []


def test_saves_in_flight_count_as_held_until_discarded_or_reset(store, index):
    k0, k1, k2 = new_keys(3)
    put_object(store, k0)
    assert index.count_prefix([k0, k1, k2]) == 1
    # Saves sent for k1 and k2: a load queued after them reads them.
    index.add([k1, k2])
    assert index.count_prefix([k0, k1, k2]) == 3
    assert index.missing([k0, k1, k2]) == [False, False, False]
    # The worker reports k1's save failed: only the master answers for it again.
    index.discard([k1])
    assert index.count_prefix([k0, k1, k2]) == 1
    assert index.missing([k0, k1, k2]) == [False, True, False]
    # A worker's hello: no save of it is in flight any more.
    index.reset([k2])
    assert index.pending == {}
    assert index.missing([k0, k1, k2]) == [False, True, True]


def test_saves_in_flight_stop_counting_after_their_ttl(index):
    (key,) = new_keys(1)
    ttl = index.pending_ttl_s
    try:
        index.pending_ttl_s = 0.05
        index.add([key])
        assert index.count_prefix([key]) == 1
        time.sleep(0.1)
        # Never written (or evicted since): the master says it is not there.
        assert index.count_prefix([key]) == 0
        assert key not in index.pending
    finally:
        index.pending_ttl_s = ttl


def test_remove_drops_an_object_even_just_read(store, index):
    k0, k1 = new_keys(2)
    put_object(store, k0)
    # A read leases the object for seconds; a bad object must go all the same.
    assert store.get(k0) is not None
    store.remove(k0)
    assert store.get(k0) is None
    assert index.missing([k0]) == [True]
    store.remove(k1)  # nothing there: nothing to do


def test_a_store_without_memory_is_full(own_mooncake_master):
    master = own_mooncake_master
    store = MooncakeStore(master.master_address, master.metadata_server, local_buffer_bytes=1 << 20)
    try:
        (key,) = new_keys(1)
        with pytest.raises(StoreError) as e:
            put_object(store, key)
        assert e.value.reason == "full"
        assert store.get(key) is None
    finally:
        store.close()


def _closed_port() -> int:
    port = free_port()
    with socket.socket() as s:
        assert s.connect_ex(("127.0.0.1", port)) != 0
    return port


def test_an_unreachable_master_fails_the_setup_fast(needs_mooncake):
    master, meta = f"127.0.0.1:{_closed_port()}", f"http://127.0.0.1:{_closed_port()}/metadata"
    t0 = time.monotonic()
    with pytest.raises(StoreError) as e:
        MooncakeStore(master, meta)
    assert e.value.reason == "unreachable"
    with pytest.raises(ValueError, match="does not accept connections"):
        MooncakeKeyIndex(master, meta)
    assert time.monotonic() - t0 < 10
    with pytest.raises(ValueError, match="not host:port"):
        MooncakeStore("localhost", meta)
    with pytest.raises(ValueError, match="not host:port"):
        MooncakeKeyIndex("localhost:port", meta)


def test_a_master_gone_holds_nothing_and_costs_no_wait(own_mooncake_master, caplog):
    master = own_mooncake_master
    # NOTE: no segment (the default): a client that lends memory spends seconds leaving a
    # master that is gone.
    store = MooncakeStore(master.master_address, master.metadata_server, local_buffer_bytes=1 << 20)
    index = MooncakeKeyIndex(master.master_address, master.metadata_server, retry_s=60.0)
    try:
        keys = new_keys(3)
        index.add(keys[:1])
        assert index.missing(keys) == [False, True, True]
        master.stop()
        caplog.set_level(logging.WARNING, logger="kvpool.scheduler.mooncake_index")
        t0 = time.monotonic()
        # Even the save in flight: a lookup answers for every key or for none.
        assert index.count_prefix(keys) == 0
        assert index.missing(keys) == [False, False, False]
        assert index.count_prefix(keys) == 0
        assert time.monotonic() - t0 < 2
        assert index.num_unreachable == 3
        warnings = [r for r in caplog.records if r.name == "kvpool.scheduler.mooncake_index"]
        assert len(warnings) == 1 and "did not answer" in warnings[0].getMessage()
        for _ in range(2):
            with pytest.raises(StoreError) as e:
                store.put(keys[1], b"h" * 64, b"p" * 64)
            assert e.value.reason == "unreachable"
        with pytest.raises(StoreError):
            store.get(keys[1])
        assert time.monotonic() - t0 < 10
    finally:
        index.close()
        store.close()
