"""The simulator's pieces: packed-block hashing, precomputed prompt hashes, bulk
output appends, trace prompts memoised per hash-id prefix, the decode horizon."""

from __future__ import annotations

import pytest

from loadgen.datasets import MooncakeRecord, expand_hash_ids
from scheduler.core.hashing import NONE_HASH, BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from simulator.fastforward import decode_horizon, num_new_blocks
from simulator.workload import OUTPUT_TOKEN_BASE, SampleWorkload, TraceWorkload


@pytest.mark.parametrize("algo", ["sha256", "xxhash"])
def test_chain_packed_blocks_equals_extend_block_hashes(algo: str):
    hasher = BlockHasher(16, algo)
    tokens = expand_hash_ids([7, 8], None)
    whole = hasher.block_hashes(tokens.tolist())
    first = hasher.chain_packed_blocks(NONE_HASH, tokens[:512].astype("<u4").tobytes())
    second = hasher.chain_packed_blocks(first[-1], tokens[512:].astype("<u4").tobytes())
    assert first + second == whole
    with pytest.raises(ValueError, match="whole number"):
        hasher.chain_packed_blocks(NONE_HASH, b"\0" * 12)


def test_request_with_precomputed_hashes_and_bulk_appends_equals_the_plain_one():
    hasher = BlockHasher(4)
    prompt = list(range(2, 13))  # 11 tokens: 2 full blocks
    plain = Request("a", prompt, 20, block_hasher=hasher)
    given = Request("b", prompt, 20, block_hasher=hasher, block_hashes=hasher.block_hashes(prompt)[:1])
    assert given.block_hashes == plain.block_hashes
    for t in range(100, 110):
        plain.append_output_token_id(t)
    given.append_output_token_ids(list(range(100, 103)))
    given.append_output_token_ids([])
    given.append_output_token_ids(list(range(103, 110)))
    assert given.all_token_ids == plain.all_token_ids and given.block_hashes == plain.block_hashes


@pytest.mark.parametrize("block_size", [16, 64, 24])
def test_trace_prompts_hash_as_their_expanded_tokens(block_size: int):
    records = [
        MooncakeRecord(0.0, 1000, 3, (1, 2)),
        MooncakeRecord(1.0, 1500, 3, (1, 2, 3)),  # extends the first
        MooncakeRecord(2.0, 700, 3, (1, 4)),  # shares only the first id
        MooncakeRecord(3.0, 1024, 3, (1, 2)),  # the first again, whole blocks
        MooncakeRecord(4.0, 40, 3, (9,)),
    ]
    workload = TraceWorkload(records)
    hasher = BlockHasher(block_size, "xxhash")
    for run in range(2):  # a second run rebuilds the memo
        workload.reset()
        for i, r in enumerate(records):
            prompt, hashes = workload.prompt(i, hasher)
            tokens = expand_hash_ids(r.hash_ids, r.input_length).tolist()
            req = Request(str(i), prompt, 3, block_hasher=hasher, block_hashes=hashes)
            assert req.block_hashes == hasher.block_hashes(tokens), (run, i)
            assert len(prompt) == r.input_length
            tail = r.input_length % block_size
            assert prompt[len(prompt) - tail :] == tokens[len(tokens) - tail :]
        if 512 % block_size == 0:
            assert workload._memo == {}  # every entry dropped after its last use
    assert [s.arrival_ns for s in workload.specs] == [0, 1_000_000, 2_000_000, 3_000_000, 4_000_000]


def test_output_token_ids_are_unique_per_request_and_above_the_vocabulary():
    from loadgen.datasets import SampleRequest

    samples = [SampleRequest([2, 3], n) for n in (5, 1, 7)]
    workload = SampleWorkload(samples, [0.0, 0.0, 0.0], 512)
    ids = [workload.output_token_base[i] + k for i, s in enumerate(samples) for k in range(s.output_len)]
    assert len(set(ids)) == len(ids) and min(ids) == OUTPUT_TOKEN_BASE
    with pytest.raises(ValueError, match="overlaps"):
        SampleWorkload(samples, [0.0] * 3, OUTPUT_TOKEN_BASE + 1)


def test_num_new_blocks_counts_block_boundaries():
    for bs in (1, 4, 16):
        for n in range(1, 40):
            for k in range(0, 40):
                expected = sum(1 for j in range(k) if (n + j - 1) % bs == 0)
                assert num_new_blocks(n, k, bs) == expected


def _decoding(num_free_blocks: int, max_model_len: int = 1000) -> Scheduler:
    kv = KVCacheManager(num_free_blocks + 1, 4, max_model_len)
    sched = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=max_model_len)
    for r in (Request("a", [2] * 9, 50), Request("b", [2] * 30, 6)):
        r.num_computed_tokens = r.num_tokens - 1
        sched.running.append(r)
    return sched


def test_decode_horizon_stops_before_a_finish_and_before_running_out_of_blocks():
    # b can decode 6 - 0 - 1 = 5 more steps without finishing.
    assert decode_horizon(_decoding(100), 1000) == 5
    assert decode_horizon(_decoding(100), 3) == 3
    assert decode_horizon(_decoding(100, max_model_len=34), 1000) == 34 - 30 - 1  # b reaches max_model_len
    # a (9 tokens) takes a block at steps 0 and 4; b (30 tokens) at step 3.
    need = [sum(num_new_blocks(n, k, 4) for n in (9, 30)) for k in range(6)]
    assert need == [0, 1, 1, 1, 2, 3]  # blocks taken within the first k steps
    for free in range(1, 4):
        k = decode_horizon(_decoding(free), 1000)
        assert need[k] <= free and (k == 5 or need[k + 1] > free)
