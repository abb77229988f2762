"""Workloads for the offline simulator: a Mooncake trace or a load-generator dataset.

A workload is a list of `SimSpec` (arrival in virtual ns, prompt and output
lengths) plus a way to build each prompt when the request arrives (never all at
once: the whole conversation trace is ~145M prompt tokens).

Trace prompts: each hash id stands for 512 tokens (`loadgen.datasets.expand_hash_ids`),
and equal ids at equal positions mean an equal prefix. The hashes of the 16-token
blocks inside a 512-token block depend on the whole prefix, so they are memoised per
*prefix of hash ids* (a chain node), and dropped after the node's last use. The
simulator has no worker, so a prompt's tokens are read only to hash them: the token
list holds the padding id 0 where every block is full and hashed already, and the
real tokens only in the last, partial block, whose hash continues with the request's
output tokens. Every block hash is therefore exactly what a real run would compute.

Generated tokens are unique to their request: request i's k-th output token is
`OUTPUT_TOKEN_BASE + offset_i + k` (offsets cumulative over output lengths), at or
above every prompt vocabulary and below 2**31.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from loadgen.datasets import (
    DEFAULT_VOCAB_SIZE,
    MOONCAKE_BLOCK_TOKENS,
    MooncakeRecord,
    SampleRequest,
    expand_hash_ids,
)
from scheduler.core.hashing import NONE_HASH, BlockHasher
from scheduler.core.kv_cache_block import BlockHash

OUTPUT_TOKEN_BASE = 1 << 24
MAX_TOKEN_ID = (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class SimSpec:
    """One request of a workload: when it arrives, how long it is, its priority
    (lower first under --scheduling-policy priority)."""

    arrival_ns: int
    prompt_len: int
    output_len: int
    priority: int = 0


class Workload:
    """Specs plus prompt building. `prompt(i)` is called once per request, in
    arrival order; it returns (prompt token ids, precomputed block hashes or None)."""

    def __init__(self, specs: list[SimSpec], vocab_size: int):
        if vocab_size > OUTPUT_TOKEN_BASE:
            raise ValueError(f"vocab_size {vocab_size} overlaps the output token ids (from {OUTPUT_TOKEN_BASE})")
        self.specs = specs
        offsets = np.concatenate([[0], np.cumsum([s.output_len for s in specs], dtype=np.int64)])
        if OUTPUT_TOKEN_BASE + int(offsets[-1]) > MAX_TOKEN_ID:
            raise ValueError(f"{int(offsets[-1])} output tokens in all: too many for unique token ids below 2**31")
        # First output token id of each request.
        self.output_token_base: list[int] = (offsets[:-1] + OUTPUT_TOKEN_BASE).tolist()

    def __len__(self) -> int:
        return len(self.specs)

    def prompt(self, index: int, hasher: BlockHasher) -> tuple[list[int], list[BlockHash] | None]:
        raise NotImplementedError

    def reset(self) -> None:
        """Start a new run (memoised state, if any, is rebuilt)."""


class SampleWorkload(Workload):
    """A load-generator dataset (token lists in memory; the Request hashes them)."""

    def __init__(self, samples: Sequence[SampleRequest], arrivals_s: Sequence[float], vocab_size: int):
        specs = [
            SimSpec(round(t * 1e9), s.prompt_len, s.output_len) for s, t in zip(samples, arrivals_s, strict=True)
        ]
        super().__init__(specs, vocab_size)
        self.samples = samples

    def prompt(self, index: int, hasher: BlockHasher) -> tuple[list[int], list[BlockHash] | None]:
        return self.samples[index].prompt_token_ids, None


class TraceWorkload(Workload):
    """A Mooncake trace, prompts expanded and hashed on arrival (see the module doc)."""

    def __init__(
        self,
        records: Sequence[MooncakeRecord],
        time_scale: float = 1.0,
        vocab_size: int = DEFAULT_VOCAB_SIZE,
        max_input_len: int | None = None,
    ):
        specs = []
        for r in records:
            n = r.input_length if max_input_len is None else min(r.input_length, max_input_len)
            if n > len(r.hash_ids) * MOONCAKE_BLOCK_TOKENS:
                raise ValueError(f"input_length {n} exceeds {len(r.hash_ids)} blocks of {MOONCAKE_BLOCK_TOKENS}")
            specs.append(SimSpec(round(r.timestamp * 1e6 * time_scale), n, r.output_length))
        super().__init__(specs, vocab_size)
        self.vocab_size = vocab_size
        # Chain nodes: (parent node, hash id) -> node; each request's nodes in order;
        # the last request to use each node (its memo entry is dropped after it).
        node_of: dict[tuple[int, int], int] = {}
        self.nodes: list[list[int]] = []
        self.node_hash_id: list[int] = []
        last_use: list[int] = []
        for i, (r, s) in enumerate(zip(records, specs, strict=True)):
            parent = -1
            chain = []
            for h in r.hash_ids[: -(-s.prompt_len // MOONCAKE_BLOCK_TOKENS)]:
                node = node_of.get((parent, h))
                if node is None:
                    node = node_of[(parent, h)] = len(self.node_hash_id)
                    self.node_hash_id.append(h)
                    last_use.append(i)
                last_use[node] = i
                chain.append(node)
                parent = node
            self.nodes.append(chain)
        self._last_use = last_use
        self._memo: dict[int, list[BlockHash]] = {}
        self._memo_key: tuple[int, str] | None = None

    def reset(self) -> None:
        self._memo.clear()
        self._memo_key = None

    def _node_tokens(self, node: int) -> np.ndarray:
        return expand_hash_ids([self.node_hash_id[node]], None, self.vocab_size)

    def prompt(self, index: int, hasher: BlockHasher) -> tuple[list[int], list[BlockHash] | None]:
        n = self.specs[index].prompt_len
        bs = hasher.block_size
        chain = self.nodes[index]
        tail = n % bs
        if MOONCAKE_BLOCK_TOKENS % bs:
            # NOTE: blocks straddle the trace's 512-token blocks: no memo, hash it all.
            tokens = expand_hash_ids([self.node_hash_id[c] for c in chain], n, self.vocab_size)
            return tokens.tolist(), None
        key = (bs, hasher.algo)
        if self._memo_key != key:
            self._memo.clear()
            self._memo_key = key
        memo, last_use = self._memo, self._last_use
        hashes: list[BlockHash] = []
        parent = NONE_HASH
        for c in chain:
            node_hashes = memo.get(c)
            if node_hashes is None:
                packed = self._node_tokens(c).astype("<u4").tobytes()
                node_hashes = hasher.chain_packed_blocks(parent, packed)
                if last_use[c] > index:
                    memo[c] = node_hashes
            elif last_use[c] <= index:
                del memo[c]
            hashes.extend(node_hashes)
            parent = node_hashes[-1]
        del hashes[n // bs :]
        prompt = [0] * (n - tail)
        if tail:
            last = self._node_tokens(chain[-1])
            start = (n - tail) % MOONCAKE_BLOCK_TOKENS
            prompt.extend(last[start : start + tail].tolist())
        return prompt, hashes
