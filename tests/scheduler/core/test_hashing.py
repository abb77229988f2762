"""Chained block hashes: deterministic, salted on the first block, packed tokens."""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler.core.hashing import NONE_HASH, BlockHasher

REPO = Path(__file__).resolve().parents[3]
TOKENS = list(range(1000, 1018))  # 4 full blocks of 4 and 2 tokens over


def test_first_block_is_sha256_of_seed_and_packed_tokens():
    h = BlockHasher(4)
    expected = hashlib.sha256(NONE_HASH + struct.pack("<4I", 1000, 1001, 1002, 1003)).digest()
    assert h.block_hashes(TOKENS)[0] == expected
    assert h.hash_block_tokens(NONE_HASH, [1000, 1001, 1002, 1003]) == expected
    # Chained: the second block's input starts with the first's hash.
    second = hashlib.sha256(expected + struct.pack("<4I", 1004, 1005, 1006, 1007)).digest()
    assert h.block_hashes(TOKENS)[1] == second


def test_tokens_are_packed_not_pickled():
    import pickle

    h = BlockHasher(4)
    pickled = hashlib.sha256(NONE_HASH + pickle.dumps((1000, 1001, 1002, 1003))).digest()
    assert h.block_hashes(TOKENS)[0] != pickled
    # Token ids up to 2**32 - 1 fit; more does not silently wrap.
    assert len(h.hash_block_tokens(NONE_HASH, [2**32 - 1] * 4)) == 32
    with pytest.raises(struct.error):
        h.hash_block_tokens(NONE_HASH, [2**32] * 4)


def test_partial_blocks_are_not_hashed():
    h = BlockHasher(4)
    assert len(h.block_hashes(TOKENS)) == 4
    assert h.block_hashes(TOKENS[:3]) == []
    assert len(h.block_hashes(TOKENS[:8])) == 2
    assert h.block_hashes(TOKENS[:9]) == h.block_hashes(TOKENS[:8])


def test_chained_an_early_change_changes_every_later_hash():
    h = BlockHasher(4)
    base = h.block_hashes(TOKENS)
    changed = list(TOKENS)
    changed[5] += 1  # in block 1
    other = h.block_hashes(changed)
    assert other[0] == base[0]
    assert all(a != b for a, b in zip(base[1:], other[1:], strict=True))
    # A change in the last block changes only the last hash.
    changed = list(TOKENS)
    changed[15] += 1
    other = h.block_hashes(changed)
    assert other[:3] == base[:3] and other[3] != base[3]


def test_same_block_at_different_positions_hashes_differently():
    h = BlockHasher(4)
    hashes = h.block_hashes([7, 7, 7, 7] * 3)
    assert len(set(hashes)) == 3


def test_salt_changes_only_the_first_input_but_the_whole_chain():
    h = BlockHasher(4)
    plain = h.block_hashes(TOKENS)
    salted = h.block_hashes(TOKENS, cache_salt="tenant-a")
    assert all(a != b for a, b in zip(plain, salted, strict=True))
    # Block 0's input carries the salt; block 1's input is only parent + tokens.
    first = salted[0]
    assert first != hashlib.sha256(NONE_HASH + struct.pack("<4I", *TOKENS[:4])).digest()
    assert salted[1] == h.hash_block_tokens(first, TOKENS[4:8])
    assert salted[2] == h.hash_block_tokens(salted[1], TOKENS[8:12])
    # The same salt again gives the same chain.
    assert h.block_hashes(TOKENS, cache_salt="tenant-a") == salted


def test_different_salts_differ_and_no_salt_equals_empty_salt():
    h = BlockHasher(4)
    a = h.block_hashes(TOKENS, cache_salt="a")
    b = h.block_hashes(TOKENS, cache_salt="b")
    assert set(a).isdisjoint(b)
    assert h.block_hashes(TOKENS, cache_salt=None) == h.block_hashes(TOKENS, cache_salt="") == h.block_hashes(TOKENS)


def test_sha256_and_xxhash_differ_each_deterministic():
    s1, s2 = BlockHasher(4, "sha256"), BlockHasher(4, "sha256")
    x1, x2 = BlockHasher(4, "xxhash"), BlockHasher(4, "xxhash")
    assert s1.block_hashes(TOKENS) == s2.block_hashes(TOKENS)
    assert x1.block_hashes(TOKENS) == x2.block_hashes(TOKENS)
    assert set(s1.block_hashes(TOKENS)).isdisjoint(x1.block_hashes(TOKENS))
    assert all(len(d) == 16 for d in x1.block_hashes(TOKENS))  # xxh3-128
    assert all(len(d) == 32 for d in s1.block_hashes(TOKENS))


def test_unknown_algo_is_rejected_by_name():
    with pytest.raises(ValueError, match="md5"):
        BlockHasher(4, "md5")


def test_bad_block_size_is_rejected():
    with pytest.raises(ValueError):
        BlockHasher(0)


def test_extend_block_hashes_is_incremental():
    h = BlockHasher(4)
    for salt in (None, "s"):
        at_once = h.block_hashes(TOKENS, cache_salt=salt)
        grown: list[bytes] = []
        for n in range(len(TOKENS) + 1):
            h.extend_block_hashes(grown, TOKENS[:n], cache_salt=salt)
            assert grown == at_once[: n // 4]
        # Nothing new: nothing appended.
        h.extend_block_hashes(grown, TOKENS, cache_salt=salt)
        assert grown == at_once


def test_request_keeps_hashes_up_to_date_as_tokens_arrive():
    from scheduler.sched.request import Request

    h = BlockHasher(4)
    r = Request("r", TOKENS[:6], max_tokens=20, cache_salt="s", block_hasher=h)
    assert r.block_hashes == h.block_hashes(TOKENS[:6], cache_salt="s")
    for t in TOKENS[6:]:
        r.append_output_token_id(t)
        assert r.block_hashes == h.block_hashes(TOKENS[: r.num_tokens], cache_salt="s")


_CHILD = """
import sys
from scheduler.core.hashing import BlockHasher
toks = list(range(1000, 1018))
for algo in ("sha256", "xxhash"):
    h = BlockHasher(4, algo)
    for salt in (None, "tenant-a"):
        print(" ".join(d.hex() for d in h.block_hashes(toks, cache_salt=salt)))
"""


def _expected_lines() -> list[str]:
    lines = []
    for algo in ("sha256", "xxhash"):
        h = BlockHasher(4, algo)
        for salt in (None, "tenant-a"):
            lines.append(" ".join(d.hex() for d in h.block_hashes(TOKENS, cache_salt=salt)))
    return lines


@pytest.mark.parametrize("seed", ["0", "1", "12345"])
def test_deterministic_across_processes(seed):
    env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=str(REPO))
    out = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=REPO, env=env, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert out.splitlines() == _expected_lines()
