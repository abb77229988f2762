"""Objects of the external KV tier (a disk directory, a Mooncake Store): their keys and format.

An object is one KV block of every layer, saved by one engine and read back by any engine
of the same model and KV layout -- the same engine after a restart, or a replica sharing
the store. So nothing about it may depend on a process:

* The **identity** is a digest of what makes a block's bytes meaningful: the model (its
  architecture and the hash of its config and weights' index), the KV dtype, the layout of
  a block (KV tensors, KV heads, head size; a hybrid model's KV-cache groups, which say
  whose layer each tensor holds) and the block size.
* The **key** of a block is a digest of the identity and the block's prefix-cache hash
  (chained over every token before it, with the request's ``cache_salt`` in the first
  block's: scheduler/core/hashing.py), which is seeded by a constant, never by
  ``PYTHONHASHSEED``. A key therefore names one model's KV of one exact prefix for one
  tenant: another model, dtype, block size or salt gives another key.
* An object is a fixed header (magic, version, identity, key, payload length, CRC-32 of
  the payload) and the payload. It is checked whole before one byte of it is used: a
  truncated, corrupt or foreign object (another identity under the key, by a bug or a
  shared directory) is a miss, and the block is computed again.
"""

from __future__ import annotations

import hashlib
import struct
import zlib
from collections.abc import Sequence

from protocol.kv_cache_spec import KVCacheGroupSpec

MAGIC = b"KVPB"
VERSION = 1
_HEADER = struct.Struct("<4sHH16s20sQI4x")
HEADER_SIZE = _HEADER.size
# The tier labels of vLLM's tiered offloading metrics (its "tier" label: "<index>:<type>").
BACKENDS = ("disk", "mooncake")


class BadObject(ValueError):
    """An object that must not be used: ``reason`` is one of truncated, magic, version,
    foreign, key, checksum."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


def kv_identity(architecture: str, model_hash: str, kv_dtype: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                groups: Sequence[KVCacheGroupSpec] = ()) -> str:
    """The identity of a worker's KV objects (32 hex digits). ``num_layers``: the KV
    tensors a block spans (every layer, or a hybrid model's ``num_kv_tensors``);
    ``groups``: the KV-cache groups, which count only when there are several (one group
    of every layer, or none, is the layout of every layer's own tensor)."""
    text = f"kvpool-kv/{VERSION}|{architecture}|{model_hash}|{kv_dtype}|bs={block_size}|L={num_layers}|kvh={num_kv_heads}|hd={head_dim}"
    if len(groups) > 1:
        # NOTE: only here, so the identity of a one-group layout (and the objects saved under it) stays as it was.
        text += "|groups=" + ";".join(f"{g.sliding_window}:{','.join(map(str, g.layer_ids))}" for g in groups)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def object_key(identity: str, block_hash: bytes) -> str:
    """The key of the block whose prefix-cache hash is ``block_hash`` (40 hex digits)."""
    return hashlib.sha256(bytes.fromhex(identity) + block_hash).hexdigest()[:40]


def encode_header(identity: str, key: str, payload: bytes | memoryview) -> bytes:
    """The header to write before ``payload``."""
    return _HEADER.pack(MAGIC, VERSION, 0, bytes.fromhex(identity), bytes.fromhex(key), len(payload), zlib.crc32(payload))


def encode(identity: str, key: str, payload: bytes | memoryview) -> bytes:
    """The whole object: header, then payload."""
    return encode_header(identity, key, payload) + bytes(payload)


def decode(data: bytes | memoryview, identity: str, key: str, payload_size: int) -> memoryview:
    """The payload of ``data``, checked: it must be an object of ``identity`` saved
    under ``key`` with ``payload_size`` bytes intact. Raises BadObject otherwise."""
    view = memoryview(data)
    if len(view) < HEADER_SIZE:
        raise BadObject("truncated", f"{len(view)} bytes, shorter than the header")
    magic, version, _flags, ident, obj_key, length, crc = _HEADER.unpack_from(view)
    if magic != MAGIC:
        raise BadObject("magic", f"not a kvpool KV object (magic {magic!r})")
    if version != VERSION:
        raise BadObject("version", f"object format {version}, this kvpool reads {VERSION}")
    if ident.hex() != identity:
        raise BadObject("foreign", f"made for identity {ident.hex()}, not {identity} (another model, KV dtype, layout or block size)")
    if obj_key.hex() != key:
        raise BadObject("key", f"holds block {obj_key.hex()}, not {key}")
    payload = view[HEADER_SIZE:]
    if length != payload_size or len(payload) != length:
        raise BadObject("truncated", f"{len(payload)} payload bytes, the header says {length}, a block has {payload_size}")
    if zlib.crc32(payload) != crc:
        raise BadObject("checksum", "the payload's CRC-32 differs from the header's")
    return payload
