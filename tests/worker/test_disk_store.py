"""DiskStore (worker/external/disk_store.py): one file per object, bounded in bytes with the
least recently used removed first (a read counts as a use), and a directory that outlives
the process -- a new store lists what an earlier one wrote, oldest first, drops its
half-written ``.tmp`` files and trims it to its own bound."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from protocol.external_kv import object_key
from worker.external.disk_store import DiskStore
from worker.external.store_errors import StoreError

IDENTITY = "ab" * 16
HEADER = b"H" * 8
PAYLOAD = b"p" * 92  # an object is 100 bytes on disk


def key(i: int) -> str:
    return object_key(IDENTITY, i.to_bytes(32, "big"))


def path(store: DiskStore, k: str) -> Path:
    return store.dir / k[:2] / f"{k}.kv"


def obj(i: int) -> bytes:
    return HEADER + bytes([i]) * len(PAYLOAD)


def put(store: DiskStore, i: int) -> list[str]:
    return store.put(key(i), HEADER, obj(i)[len(HEADER) :])


def test_put_then_get_and_a_missing_key(tmp_path):
    store = DiskStore(tmp_path, 1000, IDENTITY)
    assert store.dir == tmp_path / IDENTITY and store.keys() == [] and store.used_bytes == 0
    assert put(store, 1) == []
    assert store.get(key(1)) == obj(1) and path(store, key(1)).read_bytes() == obj(1)
    assert key(1) in store and len(store) == 1 and store.used_bytes == 100
    assert store.get(key(2)) is None and key(2) not in store
    assert put(store, 1) == [] and store.used_bytes == 100  # the same key again: held already
    store.remove(key(1))
    assert store.get(key(1)) is None and not path(store, key(1)).exists() and store.used_bytes == 0


def test_a_file_removed_behind_its_back_is_a_miss_and_forgotten(tmp_path):
    store = DiskStore(tmp_path, 1000, IDENTITY)
    put(store, 1)
    path(store, key(1)).unlink()
    assert store.get(key(1)) is None
    assert key(1) not in store and store.used_bytes == 0


def test_the_bound_removes_the_least_recently_used_first_and_a_get_is_a_use(tmp_path):
    store = DiskStore(tmp_path, 300, IDENTITY)  # room for three objects
    for i in (1, 2, 3):
        assert put(store, i) == []
    # LRU first: 1 2 3; reading 1 makes it the most recent: 2 3 1.
    assert store.get(key(1)) == obj(1)
    assert store.keys() == [key(2), key(3), key(1)]
    assert put(store, 4) == [key(2)]  # 3 1 4
    assert store.get(key(3)) == obj(3)  # 1 4 3
    # An object twice the size needs two slots: 1 then 4 go, in that order.
    assert store.put(key(5), HEADER, b"q" * 192) == [key(1), key(4)]
    assert store.keys() == [key(3), key(5)] and store.used_bytes == 300
    for gone in (1, 2, 4):
        assert not path(store, key(gone)).exists() and store.get(key(gone)) is None
    assert {f.stem for f in store.dir.rglob("*.kv")} == {key(3), key(5)}


def test_an_object_larger_than_the_bound_is_refused_as_full(tmp_path):
    store = DiskStore(tmp_path, 99, IDENTITY)
    with pytest.raises(StoreError) as e:
        put(store, 1)
    assert e.value.reason == "full" and "99 bytes" in str(e.value)
    assert store.keys() == [] and list(store.dir.rglob("*.kv")) == []


def test_a_second_store_lists_what_the_first_wrote_oldest_first(tmp_path):
    first = DiskStore(tmp_path, 1000, IDENTITY)
    for i in (1, 2, 3):
        put(first, i)
    first.get(key(1))  # a use in memory only: the listing goes by the files' times
    t = 1_700_000_000
    for age, i in enumerate((2, 3, 1)):
        os.utime(path(first, key(i)), ns=((t + age) * 10**9, (t + age) * 10**9))
    stray = path(first, key(1)).parent / f"{key(9)}.tmp"  # a write a killed process left half done
    stray.write_bytes(b"half an object")
    first.close()

    second = DiskStore(tmp_path, 1000, IDENTITY)
    assert second.keys() == [key(2), key(3), key(1)] and second.used_bytes == 300
    assert not stray.exists()
    assert second.get(key(3)) == obj(3)
    # Another identity's directory under the same root holds nothing of this one's.
    assert DiskStore(tmp_path, 1000, "cd" * 16).keys() == []


def test_a_second_store_with_a_smaller_bound_removes_the_oldest(tmp_path):
    first = DiskStore(tmp_path, 1000, IDENTITY)
    for i in (1, 2, 3, 4):
        put(first, i)
    t = 1_700_000_000
    for age, i in enumerate((3, 1, 4, 2)):
        os.utime(path(first, key(i)), ns=((t + age) * 10**9, (t + age) * 10**9))
    second = DiskStore(tmp_path, 250, IDENTITY)
    assert second.keys() == [key(4), key(2)] and second.used_bytes == 200
    assert not path(second, key(3)).exists() and not path(second, key(1)).exists()
    assert path(second, key(4)).exists() and path(second, key(2)).exists()


def test_a_size_that_is_not_positive_is_refused(tmp_path):
    with pytest.raises(ValueError, match="must be positive"):
        DiskStore(tmp_path, 0, IDENTITY)


def test_a_directory_it_cannot_use_is_named(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        if os.access(locked, os.W_OK):
            # Root ignores the mode bits: a path under a regular file cannot be made by anyone.
            target = tmp_path / "a-file"
            target.write_bytes(b"")
            root = target / "tier"
        else:
            root = locked / "tier"
        with pytest.raises(ValueError) as e:
            DiskStore(root, 1000, IDENTITY)
        assert f"--kv-offloading-path {root}" in str(e.value) and str(root / IDENTITY) in str(e.value)
    finally:
        locked.chmod(0o700)


def test_a_path_under_a_regular_file_is_refused(tmp_path):
    target = tmp_path / "a-file"
    target.write_bytes(b"")
    with pytest.raises(ValueError, match=f"--kv-offloading-path {target}/tier: cannot create"):
        DiskStore(target / "tier", 1000, IDENTITY)
