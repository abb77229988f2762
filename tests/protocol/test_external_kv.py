"""The external tier's objects (protocol/external_kv.py): an object is checked whole before
one byte of it is used, and refused with the reason of its first fault; its key names one
model's KV of one exact prefix, and is the same in every process (a restart, a replica)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

from protocol.external_kv import (
    HEADER_SIZE,
    MAGIC,
    VERSION,
    BadObject,
    decode,
    encode,
    encode_header,
    kv_identity,
    object_key,
)
from protocol.kv_cache_spec import KVCacheGroupSpec
from scheduler.core.hashing import BlockHasher

REPO = Path(__file__).resolve().parents[2]
# A model's identity, and the identity with one field changed at a time.
BASE = dict(architecture="LlamaForCausalLM", model_hash="ab" * 16, kv_dtype="bfloat16", block_size=16, num_layers=4, num_kv_heads=2, head_dim=8)
ID = kv_identity(**BASE)
HASHES = BlockHasher(16).block_hashes(list(range(2, 34)))  # two blocks' hashes, chained
KEY = object_key(ID, HASHES[0])
PAYLOAD = bytes(range(256)) * 3


def identity(**change) -> str:
    return kv_identity(**{**BASE, **change})


def test_a_good_object_round_trips():
    obj = encode(ID, KEY, PAYLOAD)
    assert len(obj) == HEADER_SIZE + len(PAYLOAD)
    assert obj[:HEADER_SIZE] == encode_header(ID, KEY, PAYLOAD) and obj[:4] == MAGIC
    assert bytes(decode(obj, ID, KEY, len(PAYLOAD))) == PAYLOAD
    assert bytes(decode(memoryview(obj), ID, KEY, len(PAYLOAD))) == PAYLOAD
    assert len(ID) == 32 and len(KEY) == 40 and int(ID, 16) >= 0 and int(KEY, 16) >= 0


def _flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x01]) + data[at + 1 :]


def _with_version(data: bytes, version: int) -> bytes:
    # The version is the u16 right after the 4-byte magic (the header is little-endian).
    return data[:4] + struct.pack("<H", version) + data[6:]


OBJ = encode(ID, KEY, PAYLOAD)
OTHER_ID = identity(kv_dtype="float8_e4m3fn")
OTHER_KEY = object_key(ID, HASHES[1])


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"", "truncated"),
        (OBJ[: HEADER_SIZE - 1], "truncated"),  # the header cut short
        (OBJ[:HEADER_SIZE], "truncated"),  # a header and no payload
        (OBJ[:-1], "truncated"),  # the payload cut short by one byte
        (OBJ + b"\0", "truncated"),  # a byte too many
        (b"XXXX" + OBJ[4:], "magic"),
        (_with_version(OBJ, VERSION + 1), "version"),
        (encode(OTHER_ID, KEY, PAYLOAD), "foreign"),  # another model's object under this key
        (encode(ID, OTHER_KEY, PAYLOAD), "key"),  # another block's object under this key
        (_flip(OBJ, HEADER_SIZE + 100), "checksum"),
        (_flip(OBJ, len(OBJ) - 1), "checksum"),
    ],
    ids=["empty", "short-header", "no-payload", "short-payload", "long-payload", "magic", "version", "foreign", "key", "flip-mid", "flip-last"],
)
def test_decode_refuses_each_bad_object_with_its_reason(data, reason):
    with pytest.raises(BadObject) as e:
        decode(data, ID, KEY, len(PAYLOAD))
    assert e.value.reason == reason and str(e.value).startswith(f"{reason}: ")


def test_a_header_that_agrees_with_a_payload_of_another_size_is_still_refused():
    """The header's length and CRC agree with the bytes, but a block of this layout has another size."""
    short = PAYLOAD[:-16]
    obj = encode(ID, KEY, short)
    assert bytes(decode(obj, ID, KEY, len(short))) == short
    with pytest.raises(BadObject) as e:
        decode(obj, ID, KEY, len(PAYLOAD))
    assert e.value.reason == "truncated"


def test_a_flipped_crc_in_the_header_is_a_checksum_fault():
    crc_at = HEADER_SIZE - 8  # the u32 CRC, then 4 pad bytes, end the header
    assert struct.unpack_from("<I", OBJ, crc_at)[0] == zlib.crc32(PAYLOAD)
    with pytest.raises(BadObject) as e:
        decode(_flip(OBJ, crc_at), ID, KEY, len(PAYLOAD))
    assert e.value.reason == "checksum"


@pytest.mark.parametrize(
    "change",
    [{"kv_dtype": "float8_e4m3fn"}, {"block_size": 32}, {"model_hash": "cd" * 16}, {"num_layers": 5}, {"architecture": "Qwen3ForCausalLM"},
     {"num_kv_heads": 4}, {"head_dim": 16}],
    ids=lambda c: next(iter(c)),
)
def test_the_identity_changes_with_each_field(change):
    assert identity(**change) != ID
    assert identity(**change) == identity(**change)  # a digest, not a random token


def test_several_kv_cache_groups_change_the_identity_and_one_does_not():
    # 4 KV tensors either way: each its own layer's, or each shared by a layer of each group.
    hybrid = [KVCacheGroupSpec([0, 2, 4, 6], 8), KVCacheGroupSpec([1, 3, 5, 7], 0)]
    assert identity(groups=[KVCacheGroupSpec([0, 1, 2, 3], 0)]) == ID
    assert identity(groups=hybrid) not in (ID, identity(groups=hybrid[::-1]))
    assert identity(groups=[KVCacheGroupSpec([0, 2, 4, 6], 16), hybrid[1]]) != identity(groups=hybrid)


def test_keys_differ_by_identity_and_by_block_hash_and_salt():
    assert object_key(ID, HASHES[0]) == KEY
    assert object_key(OTHER_ID, HASHES[0]) != KEY
    assert object_key(ID, HASHES[1]) != KEY
    salted = BlockHasher(16).block_hashes(list(range(2, 34)), cache_salt="tenant-a")
    assert object_key(ID, salted[0]) != KEY and object_key(ID, salted[1]) != object_key(ID, HASHES[1])


_KEY_SCRIPT = """
from protocol.external_kv import kv_identity, object_key
from scheduler.core.hashing import BlockHasher
ident = kv_identity("LlamaForCausalLM", "ab" * 16, "bfloat16", 16, 4, 2, 8)
print(*(object_key(ident, h) for h in BlockHasher(16).block_hashes(list(range(2, 34)), cache_salt="s")))
"""


def test_keys_do_not_depend_on_pythonhashseed():
    outs = []
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        r = subprocess.run([sys.executable, "-c", _KEY_SCRIPT], cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        outs.append(r.stdout.split())
    here = [object_key(ID, h) for h in BlockHasher(16).block_hashes(list(range(2, 34)), cache_salt="s")]
    assert outs[0] == outs[1] == here and len(here) == 2
