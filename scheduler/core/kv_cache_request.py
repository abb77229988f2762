"""KVCacheRequest: what the KV cache manager reads and writes of a request."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from scheduler.core.kv_cache_block import BlockHash


class KVCacheRequest(Protocol):
    """What the KV cache manager reads and writes of a request (the policy's
    ``scheduler.sched.request.Request`` is one): the core does not depend on the
    policy's request type."""

    request_id: str
    num_computed_tokens: int
    # The prompt's tokens (the rest of all_token_ids are outputs): a sliding-window
    # group caches the blocks a resend of the prompt would hit (hybrid groups only).
    num_prompt_tokens: int
    block_hashes: Sequence[BlockHash]
    all_token_ids: Sequence[int]
    # The one field the manager writes, and only it (every allocation, and free):
    # while the computed tokens stay at or below it, another allocation for the
    # request would allocate and cache nothing (the scheduler's decode fast path).
    alloc_noop_until: int
    # Times preempted so far: a resumed request's lookups are counted apart.
    num_preemptions: int
    # vLLM's: never read the prefix cache (a request for prompt logprobs must compute
    # every prompt position); its full blocks are still cached for others.
    skip_reading_prefix_cache: bool

    @property
    def num_tokens(self) -> int: ...
