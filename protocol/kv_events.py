"""KV cache events on the wire: vLLM's format, so routers built for vLLM read ours.

Checked against vLLM 0.33.0 (`vllm/distributed/kv_events.py` in the release wheel):

* PUB frames: ``(topic, seq, payload)``; ``seq`` is 8 bytes big-endian, one per
  batch, consecutive from 0; ``payload`` is a msgpack `KVEventBatch`.
* `KVEventBatch` is array-like: ``[ts, events, data_parallel_rank]``.
* Each event is a tagged msgpack *map*: ``{"type": "BlockStored", "block_hashes":
  ..., ...}``. NOTE: vLLM encoded events as tagged arrays (``array_like=True``)
  until vllm-project/vllm#42892 (0.23.0 still did); the batch stayed an array. Fields with a default are left out when they hold it (``omit_defaults``).
* Replay (ROUTER): a client sends the first sequence number it wants as 8 bytes
  big-endian (with a DEALER: ``[b"", seq]``); the server answers ``[b"", topic,
  seq, payload]`` for every buffered batch from there on, then the end marker
  ``[b"", b"", (-1 as 8 signed bytes), b""]``.

Block hashes are `ExternalBlockHash = bytes | int` in vLLM. vLLM 0.33.0 sends the
low 64 bits of its SHA-256 hash as an int unless VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0,
in which case it sends the bytes. kvpool does the same: ints by default
(`int_block_hash`), the full hash bytes (what its own prefix cache keys on) when
that variable is 0 or the scheduler runs with --no-kv-events-int-block-hashes.

The Struct definitions below are vLLM's, field for field and in order (order and
names are the wire contract; the docstrings are ours).
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.codec import Codec

ExternalBlockHash = bytes | int

# vLLM's medium names: the device pool's, and its CPU offloading tier's.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
# vLLM's KVCacheSpecKind values for the kinds of layer kvpool has.
KV_CACHE_SPEC_KIND_FULL_ATTENTION = "full_attention"
KV_CACHE_SPEC_KIND_SLIDING_WINDOW = "sliding_window"

SEQ_BYTES = 8
# The replay socket's last frame set for a request: seq -1, empty topic and payload.
REPLAY_END_SEQ = -1


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every event; the tag (key "type") is the class name."""


class BlockStored(KVCacheEvent):
    """Hashes newly cached, one chain from ``parent_block_hash``; ``token_ids`` are
    exactly the tokens of those blocks."""

    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None  # deprecated in vLLM, still sent
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


class BlockRemoved(KVCacheEvent):
    """Hashes no block holds any more."""

    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """Every hash is gone (a prefix-cache reset)."""


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# vLLM's environment variable (vllm/envs.py): "1" (the default) or "0".
INT_BLOCK_HASHES_ENV = "VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES"


def int_block_hashes_from_env(environ: dict[str, str]) -> bool:
    """Whether hashes go out as ints, read as vLLM reads it: ``bool(int(value))``,
    default 1. Raises ValueError naming the variable on a value that is not an int."""
    value = environ.get(INT_BLOCK_HASHES_ENV, "1")
    try:
        return bool(int(value))
    except ValueError:
        raise ValueError(f"{INT_BLOCK_HASHES_ENV}={value!r}: expected 1 (ints, the default) or 0 (bytes)") from None


def int_block_hash(block_hash: bytes) -> int:
    """vLLM's int form of a hash (its `maybe_convert_block_hash`): the low 64 bits."""
    return int.from_bytes(block_hash, "big") & ((1 << 64) - 1)


def encode_seq(seq: int) -> bytes:
    return seq.to_bytes(SEQ_BYTES, "big", signed=True)


def decode_seq(frame: bytes) -> int:
    """A sequence-number frame; -1 (`REPLAY_END_SEQ`) ends a replay."""
    if len(frame) != SEQ_BYTES:
        raise ValueError(f"a sequence number is {SEQ_BYTES} bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)


def batch_codec(max_frame_bytes: int = 64 * 1024 * 1024) -> Codec[KVEventBatch]:
    """Encoder/decoder for batch payloads; a bad payload raises `ProtocolError`."""
    return Codec(KVEventBatch, max_frame_bytes)
