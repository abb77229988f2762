"""Workloads for the load generator: synthetic shared-prefix, random, and Mooncake replay.

Every dataset is a list of `SampleRequest` (prompt token ids, output length, and, for
trace replay, an arrival offset). Token ids are drawn from [FIRST_TOKEN_ID, vocab_size):
ids 0 and 1 are reserved (1 is the model's EOS), so a prompt never contains EOS.

Mooncake traces (see shared/traces/README.md) give one hash id per 512-token block; a
prompt is rebuilt by expanding each id into 512 deterministic token ids derived from the
id alone, concatenating, and cutting to `input_length`. The expansion is a vectorised
integer hash of (hash_id, position), so equal ids give equal tokens in any process, and
distinct ids give unrelated tokens. `expand_hash_ids` is public: the offline simulator
expands whole traces with it (no per-id state, no Python loop over tokens).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FIRST_TOKEN_ID = 2  # 0 is padding, 1 is EOS: never put either in a prompt.
DEFAULT_VOCAB_SIZE = 512
MOONCAKE_BLOCK_TOKENS = 512


@dataclass(frozen=True, slots=True)
class SampleRequest:
    """One request of a workload. `arrival_s` is set only by trace replay."""

    prompt_token_ids: list[int]
    output_len: int
    arrival_s: float | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


def _check_vocab(vocab_size: int) -> int:
    if vocab_size <= FIRST_TOKEN_ID:
        raise ValueError(f"vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
    return vocab_size - FIRST_TOKEN_ID


def _random_tokens(rng: np.random.Generator, n: int, vocab_size: int) -> list[int]:
    span = _check_vocab(vocab_size)
    return (rng.integers(0, span, size=n, dtype=np.int64) + FIRST_TOKEN_ID).tolist()


def shared_prefix_requests(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    output_len: int,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[SampleRequest]:
    """`num_prefixes` system prompts of `prefix_len` tokens, each request one of them
    (round-robin, so the groups are balanced and interleaved) plus its own random
    `suffix_len`-token suffix. Prefix blocks are what the prefix cache should hit."""
    if num_prefixes < 1:
        raise ValueError("num_prefixes must be >= 1")
    rng = np.random.default_rng(seed)
    prefixes = [_random_tokens(rng, prefix_len, vocab_size) for _ in range(num_prefixes)]
    return [
        SampleRequest(
            prefixes[i % num_prefixes] + _random_tokens(rng, suffix_len, vocab_size), output_len
        )
        for i in range(num_requests)
    ]


def _length_range(length: int, range_ratio: float) -> tuple[int, int]:
    # NOTE: as vllm bench's random dataset: uniform in [len*(1-r), len*(1+r)], at least 1.
    lo = max(1, int(length * (1 - range_ratio)))
    hi = max(lo, int(length * (1 + range_ratio)))
    return lo, hi


def random_requests(
    num_requests: int,
    input_len: int,
    output_len: int,
    range_ratio: float = 0.0,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    seed: int = 0,
) -> list[SampleRequest]:
    """Independent random prompts; lengths uniform within ±range_ratio of the given ones."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio must be in [0, 1), got {range_ratio}")
    rng = np.random.default_rng(seed)
    in_lo, in_hi = _length_range(input_len, range_ratio)
    out_lo, out_hi = _length_range(output_len, range_ratio)
    in_lens = rng.integers(in_lo, in_hi + 1, size=num_requests)
    out_lens = rng.integers(out_lo, out_hi + 1, size=num_requests)
    return [
        SampleRequest(_random_tokens(rng, int(n_in), vocab_size), int(n_out))
        for n_in, n_out in zip(in_lens, out_lens, strict=True)
    ]


# ---------------------------------------------------------------- Mooncake replay


@dataclass(frozen=True, slots=True)
class MooncakeRecord:
    """One line of a Mooncake trace: `timestamp` in ms from the trace start."""

    timestamp: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def load_mooncake_trace(path: str | Path) -> list[MooncakeRecord]:
    """Read a Mooncake JSONL trace (blank lines skipped)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                records.append(
                    MooncakeRecord(
                        float(obj["timestamp"]),
                        int(obj["input_length"]),
                        int(obj["output_length"]),
                        tuple(int(h) for h in obj["hash_ids"]),
                    )
                )
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{lineno}: not a Mooncake trace record: {e}") from None
    return records


_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    x = x + _GOLDEN
    x = (x ^ (x >> np.uint64(30))) * _M1
    x = (x ^ (x >> np.uint64(27))) * _M2
    return x ^ (x >> np.uint64(31))


def expand_hash_ids(
    hash_ids: Sequence[int] | np.ndarray,
    input_length: int | None = None,
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> np.ndarray:
    """The prompt of a trace request as an int32 array: each hash id expands to
    `block_tokens` ids in [2, vocab_size) that depend only on (id, position in block),
    concatenated and cut to `input_length` (None: keep every block whole).

    Token k of block h is splitmix64(h * block_tokens + k), reduced into the range:
    equal ids give equal blocks, distinct ids unrelated ones (two distinct 16-token
    blocks collide with probability ~510**-16)."""
    span = np.uint64(_check_vocab(vocab_size))
    ids = np.asarray(hash_ids, dtype=np.uint64)
    n_blocks = len(ids)
    if input_length is not None:
        if input_length > n_blocks * block_tokens:
            raise ValueError(
                f"input_length {input_length} exceeds {n_blocks} blocks of {block_tokens}"
            )
        n_blocks = -(-input_length // block_tokens)  # only the blocks that survive the cut
        ids = ids[:n_blocks]
    keys = (
        ids[:, None] * np.uint64(block_tokens) + np.arange(block_tokens, dtype=np.uint64)
    ).ravel()
    tokens = (_splitmix64(keys) % span).astype(np.int32) + FIRST_TOKEN_ID
    return tokens if input_length is None else tokens[:input_length]


def mooncake_requests(
    records: Sequence[MooncakeRecord],
    vocab_size: int = DEFAULT_VOCAB_SIZE,
    time_scale: float = 1.0,
    max_input_len: int | None = None,
    num_requests: int | None = None,
) -> list[SampleRequest]:
    """Trace records as requests: arrivals at timestamp (ms) × time_scale, in seconds;
    prompts over `max_input_len` are cut to it (keeping the trace's arrival pattern)."""
    if num_requests is not None:
        records = records[:num_requests]
    out = []
    for r in records:
        n = r.input_length if max_input_len is None else min(r.input_length, max_input_len)
        tokens = expand_hash_ids(r.hash_ids, n, vocab_size)
        out.append(
            SampleRequest(tokens.tolist(), r.output_length, r.timestamp / 1000.0 * time_scale)
        )
    return out
