"""DiskStore: KV objects as files in a directory, bounded in bytes (--kv-offloading-backend disk).

One file per block, ``<root>/<identity>/<key[:2]>/<key>.kv`` (protocol/external_kv.py: the
identity separates models and layouts; the fan-out keeps directories small). A file is
written whole to ``.tmp`` and renamed into place, so a reader never sees half an object
under its key, and a process killed mid-write leaves only a ``.tmp``, removed at the next
start. Files are not fsync'ed: a killed process loses nothing the kernel already holds,
and a crashed host may leave a truncated file, which the object's check refuses.

The directory outlives the process: at start the store lists what it holds (oldest first,
by modification time), and that listing is what the scheduler's index starts from. Past
``max_bytes``, the least recently used objects are removed to make room (a read counts as
a use); the keys removed are returned so the scheduler stops looking for them.

Not thread-safe: one I/O thread owns it (worker/external/external_io.py).
"""

from __future__ import annotations

import errno
import logging
import os
from collections import OrderedDict
from pathlib import Path

from worker.external.store_errors import StoreError

log = logging.getLogger("kvpool.worker.disk_store")

SUFFIX = ".kv"


class DiskStore:
    name = "disk"
    # A full disk stays full until someone frees space: saving pauses as long as after any failure.
    full_pause_s = 30.0

    def __init__(self, root: str | os.PathLike, max_bytes: int, identity: str):
        if max_bytes < 1:
            raise ValueError(f"the disk tier's size must be positive, got {max_bytes} bytes")
        self.root = Path(root)
        self.dir = self.root / identity
        self.max_bytes = max_bytes
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"--kv-offloading-path {root}: cannot create {self.dir}: {e.strerror}") from e
        if not os.access(self.dir, os.W_OK | os.X_OK):
            raise ValueError(f"--kv-offloading-path {root}: {self.dir} is not writable")
        # key -> bytes on disk, least recently used first.
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self.used_bytes = 0
        self._scan()

    def _scan(self) -> None:
        found = []
        for sub in self.dir.iterdir():
            if not sub.is_dir():
                continue
            for f in sub.iterdir():
                if f.suffix == ".tmp":
                    f.unlink(missing_ok=True)  # a write a killed process left half done
                elif f.suffix == SUFFIX:
                    st = f.stat()
                    found.append((st.st_mtime_ns, f.stem, st.st_size))
        found.sort()
        for _, key, size in found:
            self._sizes[key] = size
            self.used_bytes += size
        # A smaller bound than last time: the oldest go now.
        removed = self._make_room(0)
        if found:
            log.info("disk tier %s: %d blocks (%d bytes) from an earlier run%s", self.dir, len(self._sizes), self.used_bytes,
                     f", {len(removed)} removed to fit {self.max_bytes} bytes" if removed else "")

    def _path(self, key: str) -> Path:
        return self.dir / key[:2] / (key + SUFFIX)

    def keys(self) -> list[str]:
        """Every key held, least recently used first."""
        return list(self._sizes)

    def __contains__(self, key: str) -> bool:
        return key in self._sizes

    def __len__(self) -> int:
        return len(self._sizes)

    def put(self, key: str, header: bytes, payload: bytes | memoryview) -> list[str]:
        """Write one object (``header`` then ``payload``) under ``key``. Returns the keys
        removed to make room. Raises StoreError (nothing changed but those removals) when
        the disk is full or refuses the write."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return []
        size = len(header) + len(payload)
        if size > self.max_bytes:
            raise StoreError("full", f"an object of {size} bytes exceeds the disk tier's {self.max_bytes} bytes")
        removed = self._make_room(size)
        path = self._path(key)
        tmp = path.with_suffix(".tmp")
        try:
            path.parent.mkdir(exist_ok=True)
            with open(tmp, "wb") as f:
                f.write(header)
                f.write(payload)
            os.replace(tmp, path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            reason = "full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else "io"
            raise StoreError(reason, f"disk tier {self.dir}: writing {key}: {e.strerror or e}") from e
        self._sizes[key] = size
        self.used_bytes += size
        return removed

    def get(self, key: str) -> bytes | None:
        """The object under ``key`` (unchecked), or None when there is none."""
        try:
            with open(self._path(key), "rb") as f:
                data = f.read()
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as e:
            raise StoreError("io", f"disk tier {self.dir}: reading {key}: {e.strerror or e}") from e
        if key in self._sizes:
            self._sizes.move_to_end(key)
        return data

    def remove(self, key: str) -> None:
        """Drop the object under ``key`` (a bad one), if any."""
        self._path(key).unlink(missing_ok=True)
        self._forget(key)

    def _forget(self, key: str) -> None:
        size = self._sizes.pop(key, None)
        if size is not None:
            self.used_bytes -= size

    def _make_room(self, size: int) -> list[str]:
        """Remove the least recently used objects until ``size`` more bytes fit."""
        removed = []
        while self._sizes and self.used_bytes + size > self.max_bytes:
            key, old = self._sizes.popitem(last=False)
            self.used_bytes -= old
            self._path(key).unlink(missing_ok=True)
            removed.append(key)
        return removed

    def close(self) -> None:
        pass
