"""vLLM's exact block hashes (scheduler/core/vllm_hashing.py) against hashes recorded from
vLLM 0.32's own functions (data/record_vllm_block_hashes.py, run in the vLLM venv): the
seed rule, the chain, the cache_salt extra key and the 64-bit event form, per algorithm."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from protocol.kv_events import int_block_hash
from scheduler.core.hashing import BlockHasher
from scheduler.core.vllm_hashing import (
    DEFAULT_PREFIX_CACHING_HASH_ALGO,
    PREFIX_CACHING_HASH_ALGOS,
    VLLM_HASH_ALGOS,
    VllmBlockHasher,
    make_block_hasher,
)

DATA = Path(__file__).parent / "data"
UNSET = json.loads((DATA / "vllm_block_hashes_unset.json").read_text())
SEEDED = json.loads((DATA / "vllm_block_hashes_12345.json").read_text())
CASES = [(algo, salt) for algo in VLLM_HASH_ALGOS for salt in (None, "tenant-a")]


@pytest.mark.parametrize(("algo", "salt"), CASES)
def test_hashes_equal_vllms_with_pythonhashseed_set(algo, salt):
    want = SEEDED["out"][f"{algo}/{salt}"]
    h = VllmBlockHasher(4, algo, python_hash_seed=SEEDED["seed"])
    got = h.block_hashes(SEEDED["tokens"], salt)
    assert h.none_hash.hex() == want["none_hash"]
    assert [x.hex() for x in got] == want["hashes"]
    assert [int_block_hash(x) for x in got] == want["event"]  # what BlockStored carries


@pytest.mark.parametrize(("algo", "salt"), [c for c in CASES if c[0].startswith("sha256")])
def test_sha256_ones_use_vllms_fixed_seed_without_pythonhashseed(algo, salt):
    want = UNSET["out"][f"{algo}/{salt}"]
    h = VllmBlockHasher(4, algo, python_hash_seed=None)
    assert h.none_hash_seed == "vllm-none-hash" and h.none_hash.hex() == want["none_hash"]
    assert [x.hex() for x in h.block_hashes(UNSET["tokens"], salt)] == want["hashes"]


@pytest.mark.parametrize("algo", ["xxhash", "xxhash_cbor"])
def test_xxhash_ones_draw_a_secret_seed_without_pythonhashseed(algo):
    a, b = VllmBlockHasher(4, algo), VllmBlockHasher(4, algo)
    # As vLLM: a random per-process seed, so two processes do not share hashes.
    assert a.none_hash != b.none_hash and a.none_hash.hex() != UNSET["out"][f"{algo}/None"]["none_hash"]


def test_incremental_and_packed_forms_agree_with_the_whole():
    tokens = SEEDED["tokens"]
    h = VllmBlockHasher(4, "sha256", "12345")
    grown: list[bytes] = []
    for n in range(len(tokens) + 1):  # one token at a time, as decoding appends them
        h.extend_block_hashes(grown, tokens[:n])
    assert [x.hex() for x in grown] == SEEDED["out"]["sha256/None"]["hashes"]
    packed = b"".join(t.to_bytes(4, "little") for t in tokens)
    assert h.chain_packed_blocks(None, packed) == grown
    assert h.hash_block_tokens(grown[0], tokens[4:8]) == grown[1]


def test_the_flag_names_select_the_hasher():
    assert DEFAULT_PREFIX_CACHING_HASH_ALGO == "kvpool_sha256"
    assert PREFIX_CACHING_HASH_ALGOS == ("kvpool_sha256", "kvpool_xxhash", "sha256", "sha256_cbor", "xxhash", "xxhash_cbor")
    own = make_block_hasher(4, "kvpool_sha256")
    assert isinstance(own, BlockHasher) and own.block_hashes(SEEDED["tokens"]) == BlockHasher(4, "sha256").block_hashes(SEEDED["tokens"])
    assert isinstance(make_block_hasher(4, "kvpool_xxhash"), BlockHasher)
    exact = make_block_hasher(4, "sha256")
    assert [x.hex() for x in exact.block_hashes(UNSET["tokens"])] == UNSET["out"]["sha256/None"]["hashes"]
    with pytest.raises(ValueError, match="unknown prefix-caching hash algorithm 'md5'"):
        make_block_hasher(4, "md5")
