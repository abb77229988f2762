"""KV events are byte-compatible with vLLM's (0.33.0, vllm/distributed/kv_events.py).

`Ref*` below restate vLLM 0.33.0's Structs: the same names, fields in the same
order, the same Struct options (the wire contract). Our encoded batches must decode
with them field for field, theirs with ours, and re-encode to the same bytes. When
vLLM itself is installed, the same checks run against its own classes.
"""

from __future__ import annotations

import hashlib
from typing import Any

import msgspec
import pytest

from protocol import kv_events as wire
from protocol.codec import ProtocolError

Hash = bytes | int


class RefEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class RefKVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class RefBlockStored(RefKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Hash]
    parent_block_hash: Hash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class RefBlockRemoved(RefKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Hash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class RefAllBlocksCleared(RefKVCacheEvent, tag="AllBlocksCleared"):
    pass


class RefKVEventBatch(RefEventBatch):
    events: list[RefBlockStored | RefBlockRemoved | RefAllBlocksCleared]


H0 = hashlib.sha256(b"block 0").digest()
H1 = hashlib.sha256(b"block 1").digest()
H2 = hashlib.sha256(b"block 2").digest()


def kvpool_batch() -> wire.KVEventBatch:
    """What kvpool's publisher sends (see scheduler/engine/kv_event_publisher.to_wire_event)."""
    return wire.KVEventBatch(
        ts=1_700_000_000.25,
        events=[
            wire.BlockStored(
                block_hashes=[H0, H1], parent_block_hash=None, token_ids=list(range(8)), block_size=4,
                lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
            ),
            wire.BlockStored(
                block_hashes=[H2], parent_block_hash=H1, token_ids=[8, 9, 10, 11], block_size=4,
                lora_id=None, medium="GPU", lora_name=None, group_idx=0, kv_cache_spec_kind="full_attention",
            ),
            wire.BlockRemoved(block_hashes=[H0], medium="GPU", group_idx=0),
            wire.AllBlocksCleared(),
        ],
        data_parallel_rank=0,
    )


def every_field_batch(ns) -> Any:
    """A batch with every optional field set, built from namespace ``ns`` (ours or
    the reference), ints and bytes hashes mixed."""
    return ns["KVEventBatch"](
        ts=2.5,
        events=[
            ns["BlockStored"](
                block_hashes=[123, H1], parent_block_hash=2**64 - 1, token_ids=[1, 2, 3, 4], block_size=2,
                lora_id=7, medium="CPU", lora_name="adapter", extra_keys=[("salt",), None], group_idx=1,
                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=128, locality="LOCAL",
                ownership="tier-1", session_id="s-1", lookahead_token_ids=[[5], [6]],
            ),
            ns["BlockRemoved"](block_hashes=[123], medium="CPU", group_idx=1, locality="REMOTE", ownership="tier-1"),
            ns["AllBlocksCleared"](),
        ],
        data_parallel_rank=3,
    )


OURS = {name: getattr(wire, name) for name in ("KVEventBatch", "BlockStored", "BlockRemoved", "AllBlocksCleared")}
REF = {"KVEventBatch": RefKVEventBatch, "BlockStored": RefBlockStored, "BlockRemoved": RefBlockRemoved,
       "AllBlocksCleared": RefAllBlocksCleared}


def as_plain(batch) -> list:
    """(tag, field dict) per event: comparable across the two sets of classes."""
    return [batch.ts, [(type(e).__struct_config__.tag, msgspec.structs.asdict(e)) for e in batch.events],
            batch.data_parallel_rank]


@pytest.mark.parametrize("name", ["BlockStored", "BlockRemoved", "AllBlocksCleared", "KVEventBatch"])
def test_same_fields_in_the_same_order_and_options(name):
    ours, ref = OURS[name], REF[name]
    assert ours.__struct_fields__ == ref.__struct_fields__
    assert ours.__struct_defaults__ == ref.__struct_defaults__
    a, b = ours.__struct_config__, ref.__struct_config__
    for option in ("array_like", "omit_defaults", "tag", "tag_field", "gc"):
        assert getattr(a, option) == getattr(b, option), option


def test_kvpool_batch_decodes_with_vllm_types_field_by_field():
    ours = kvpool_batch()
    payload = wire.batch_codec().encode(ours)
    theirs = msgspec.msgpack.Decoder(RefKVEventBatch).decode(payload)
    assert as_plain(theirs) == as_plain(ours)
    stored = theirs.events[0]
    assert isinstance(stored, RefBlockStored)
    assert stored.block_hashes == [H0, H1] and stored.parent_block_hash is None
    assert stored.token_ids == list(range(8)) and stored.block_size == 4
    assert (stored.lora_id, stored.medium, stored.lora_name) == (None, "GPU", None)
    assert (stored.group_idx, stored.kv_cache_spec_kind, stored.extra_keys) == (0, "full_attention", None)
    assert isinstance(theirs.events[2], RefBlockRemoved) and theirs.events[2].block_hashes == [H0]
    assert isinstance(theirs.events[3], RefAllBlocksCleared)
    assert msgspec.msgpack.encode(theirs) == payload


@pytest.mark.parametrize("direction", ["ours->vllm", "vllm->ours"])
def test_every_field_round_trips_both_ways(direction):
    src, dst = (OURS, REF) if direction == "ours->vllm" else (REF, OURS)
    batch = every_field_batch(src)
    payload = msgspec.msgpack.encode(batch)
    decoded = msgspec.msgpack.Decoder(dst["KVEventBatch"]).decode(payload)
    assert as_plain(decoded) == as_plain(batch)
    assert msgspec.msgpack.encode(decoded) == payload


def test_raw_shape_is_an_array_batch_of_tagged_maps():
    raw = msgspec.msgpack.decode(wire.batch_codec().encode(kvpool_batch()))
    ts, events, dp_rank = raw
    assert ts == 1_700_000_000.25 and dp_rank == 0
    assert events[0] == {
        "type": "BlockStored", "block_hashes": [H0, H1], "parent_block_hash": None, "token_ids": list(range(8)),
        "block_size": 4, "lora_id": None, "medium": "GPU", "lora_name": None, "group_idx": 0,
        "kv_cache_spec_kind": "full_attention",
    }
    # Field order on the wire is the declaration order (what a positional reader of
    # the map would see); defaults that hold None are left out.
    assert list(events[0]) == ["type", *[f for f in wire.BlockStored.__struct_fields__ if f in events[0]]]
    assert events[2] == {"type": "BlockRemoved", "block_hashes": [H0], "medium": "GPU", "group_idx": 0}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_an_array_like_batch_keeps_a_trailing_default():
    # NOTE: omit_defaults does not shorten an array-like Struct: always 3 elements.
    payload = wire.batch_codec().encode(wire.KVEventBatch(ts=1.0, events=[wire.AllBlocksCleared()]))
    assert msgspec.msgpack.decode(payload) == [1.0, [{"type": "AllBlocksCleared"}], None]
    assert msgspec.msgpack.decode(payload) == msgspec.msgpack.decode(
        msgspec.msgpack.encode(RefKVEventBatch(ts=1.0, events=[RefAllBlocksCleared()]))
    )
    assert msgspec.msgpack.Decoder(RefKVEventBatch).decode(payload).data_parallel_rank is None


def test_int_block_hash_is_vllms_low_64_bits():
    # vLLM's maybe_convert_block_hash: int.from_bytes(hash, "big") & (2**64 - 1).
    assert wire.int_block_hash(H0) == int.from_bytes(H0[-8:], "big")
    assert wire.int_block_hash(b"\x01" + b"\x00" * 8) == 0
    assert 0 <= wire.int_block_hash(H1) < 2**64


def test_sequence_numbers_are_8_bytes_big_endian():
    assert wire.encode_seq(0) == b"\x00" * 8
    assert wire.encode_seq(258) == (258).to_bytes(8, "big")
    assert wire.encode_seq(wire.REPLAY_END_SEQ) == b"\xff" * 8  # vLLM's END_SEQ
    assert wire.decode_seq(b"\xff" * 8) == -1
    with pytest.raises(ValueError):
        wire.decode_seq(b"\x00" * 4)


@pytest.mark.parametrize("payload", [b"", b"\xc1", msgspec.msgpack.encode([1.0, [{"type": "Nope"}]]),
                                     msgspec.msgpack.encode({"ts": 1.0, "events": []})])
def test_bad_payloads_are_protocol_errors(payload):
    with pytest.raises(ProtocolError):
        wire.batch_codec().decode(payload)


def test_against_vllm_itself_when_installed():
    vllm_events = pytest.importorskip("vllm.distributed.kv_events")
    ns = {name: getattr(vllm_events, name) for name in OURS}
    for name in OURS:
        assert OURS[name].__struct_fields__ == ns[name].__struct_fields__
    for src, dst in ((OURS, ns), (ns, OURS)):
        payload = msgspec.msgpack.encode(every_field_batch(src))
        decoded = msgspec.msgpack.Decoder(dst["KVEventBatch"]).decode(payload)
        assert msgspec.msgpack.encode(decoded) == payload
