"""Datasets: shared-prefix structure, random lengths, Mooncake expansion."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from loadgen.datasets import (
    FIRST_TOKEN_ID,
    MOONCAKE_BLOCK_TOKENS,
    expand_hash_ids,
    load_mooncake_trace,
    mooncake_requests,
    random_requests,
    shared_prefix_requests,
)

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "conversation_trace.jsonl"


def test_shared_prefix_structure():
    reqs = shared_prefix_requests(
        20, num_prefixes=4, prefix_len=32, suffix_len=8, output_len=5, seed=1
    )
    assert len(reqs) == 20
    assert all(r.prompt_len == 40 and r.output_len == 5 for r in reqs)
    # round-robin: request i uses prefix i % 4; same group => same prefix, else different
    for i, r in enumerate(reqs):
        for j, s in enumerate(reqs):
            same = r.prompt_token_ids[:32] == s.prompt_token_ids[:32]
            assert same == (i % 4 == j % 4)
    suffixes = {tuple(r.prompt_token_ids[32:]) for r in reqs}
    assert len(suffixes) == 20
    for r in reqs:
        assert min(r.prompt_token_ids) >= FIRST_TOKEN_ID and max(r.prompt_token_ids) < 512


def test_shared_prefix_seeded_and_vocab():
    a = shared_prefix_requests(5, 2, 16, 4, 3, vocab_size=10, seed=7)
    b = shared_prefix_requests(5, 2, 16, 4, 3, vocab_size=10, seed=7)
    c = shared_prefix_requests(5, 2, 16, 4, 3, vocab_size=10, seed=8)
    assert a == b and a != c
    assert all(2 <= t < 10 for r in a for t in r.prompt_token_ids)


def test_random_lengths_within_range():
    reqs = random_requests(500, input_len=100, output_len=20, range_ratio=0.5, seed=3)
    ins = [r.prompt_len for r in reqs]
    outs = [r.output_len for r in reqs]
    assert min(ins) >= 50 and max(ins) <= 150 and len(set(ins)) > 50
    assert min(outs) >= 10 and max(outs) <= 30
    fixed = random_requests(10, input_len=64, output_len=8, range_ratio=0.0)
    assert {r.prompt_len for r in fixed} == {64} and {r.output_len for r in fixed} == {8}
    with pytest.raises(ValueError):
        random_requests(1, 10, 10, range_ratio=1.0)


def test_expand_hash_ids_deterministic_and_distinct():
    a = expand_hash_ids([5, 9, 11], 1200)
    assert a.dtype == np.int32 and a.shape == (1200,)
    assert np.array_equal(a, expand_hash_ids([5, 9, 11], 1200))
    # block k depends only on its id, not on the position of the block in the request
    b = expand_hash_ids([9], None)
    assert np.array_equal(a[512:1024], b)
    assert not np.array_equal(expand_hash_ids([5]), expand_hash_ids([6]))
    assert a.min() >= 2 and a.max() < 512
    small = expand_hash_ids([5], 512, vocab_size=7)
    assert small.min() >= 2 and small.max() < 7
    assert len(np.unique(expand_hash_ids([5]))) > 300  # spread over the vocabulary
    with pytest.raises(ValueError):
        expand_hash_ids([1], 513)


def test_mooncake_trace_equal_prefix_property():
    records = load_mooncake_trace(TRACE)
    assert len(records) == 12031
    sample = records[:400]
    reqs = mooncake_requests(sample)
    for rec, req in zip(sample, reqs, strict=True):
        assert req.prompt_len == rec.input_length
        assert req.output_len == rec.output_length
        assert req.arrival_s == rec.timestamp / 1000.0
    # equal leading hash ids <=> equal leading 512-token blocks (checked pairwise on a sample)
    for i in range(0, 400, 7):
        for j in range(i + 1, 400, 13):
            a, b = records[i], records[j]
            n = min(len(a.hash_ids), len(b.hash_ids)) - 1  # last blocks may be cut
            common = 0
            while common < n and a.hash_ids[common] == b.hash_ids[common]:
                common += 1
            pa, pb = reqs[i].prompt_token_ids, reqs[j].prompt_token_ids
            k = common * MOONCAKE_BLOCK_TOKENS
            assert pa[:k] == pb[:k]
            if common < n:
                nxt = slice(k, k + MOONCAKE_BLOCK_TOKENS)
                assert pa[nxt] != pb[nxt]
    # every conversation request shares its first block
    assert len({tuple(r.prompt_token_ids[:512]) for r in reqs}) == 1


def test_mooncake_cut_and_time_scale():
    # NOTE: how fast a trace expands is a `make bench` figure (bench/loadgen_bench.py).
    records = load_mooncake_trace(TRACE)
    reqs = mooncake_requests(records[:50], time_scale=0.5, max_input_len=1000, num_requests=20)
    assert len(reqs) == 20
    assert all(
        r.prompt_len == min(1000, rec.input_length) for r, rec in zip(reqs, records, strict=False)
    )
    assert reqs[-1].arrival_s == records[19].timestamp / 1000.0 * 0.5


def test_bad_trace_line(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(
        '{"timestamp": 0, "input_length": 3, "output_length": 1, "hash_ids": [1]}\n\n{"oops": 1}\n'
    )
    with pytest.raises(ValueError, match=":3:"):
        load_mooncake_trace(p)
