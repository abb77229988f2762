"""Checks on a client's Generate before it touches any state.

Each failure names the problem; the request is refused with a RequestError and
nothing else changes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from protocol.client_messages import Generate
from protocol.sampling_params import SamplingError, check_sampling
from protocol.structured_output import GRAMMAR_KINDS


class RequestRejected(ValueError):
    """A request that cannot be served; the message goes back to the client, with the
    field it names (``param``) when there is one."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class RequestLimits:
    vocab_size: int
    max_model_len: int
    block_size: int
    # Usable blocks (the null block excluded).
    num_usable_blocks: int
    # Hybrid KV-cache groups: the blocks a request of n cached tokens needs over every group
    # (KVCacheManager.num_blocks_needed); None: cdiv(n, block_size), as for one group.
    num_blocks_needed: Callable[[int], int] | None = None


def validate_generate(msg: Generate, limits: RequestLimits, live_request_ids) -> None:
    """Raise RequestRejected naming the first problem with ``msg``."""
    rid = msg.request_id
    if rid in live_request_ids:
        raise RequestRejected(f"duplicate request id {rid!r}: a request with this id is still running")
    n = len(msg.prompt_token_ids)
    if n == 0:
        raise RequestRejected("The decoder prompt cannot be empty")  # vLLM's words
    if msg.max_tokens < 1:
        raise RequestRejected(f"max_tokens must be at least 1, got {msg.max_tokens}")
    try:
        check_sampling(msg, limits.vocab_size)
    except SamplingError as e:
        raise RequestRejected(str(e), e.param) from None
    grammar = msg.structured_outputs
    if grammar is not None and grammar.kind not in GRAMMAR_KINDS:
        raise RequestRejected(f"structured_outputs kind must be one of {', '.join(GRAMMAR_KINDS)}, got {grammar.kind!r}")
    bad = next((t for t in msg.prompt_token_ids if t >= limits.vocab_size), None)
    if bad is not None:
        raise RequestRejected(f"token id {bad} is outside the vocabulary (0..{limits.vocab_size - 1})")
    if msg.resumed_token_ids:
        _check_resumed(msg, limits.vocab_size)
    total = n + msg.max_tokens
    if total > limits.max_model_len:
        raise RequestRejected(
            f"prompt ({n} tokens) + max_tokens ({msg.max_tokens}) = {total} is over max_model_len ({limits.max_model_len})"
        )
    # NOTE: the last sampled token is never written to the cache, hence total - 1.
    blocks = -(-(total - 1) // limits.block_size) if limits.num_blocks_needed is None else limits.num_blocks_needed(total - 1)
    if blocks > limits.num_usable_blocks:
        raise RequestRejected(
            f"request needs {blocks} KV blocks but the whole pool holds {limits.num_usable_blocks}"
        )


def _check_resumed(msg: Generate, vocab_size: int) -> None:
    """A resubmitted request's output so far must leave it something to sample, fit the
    vocabulary, and not ask for prompt logprobs again (they came with its first token)."""
    resumed = msg.resumed_token_ids
    if len(resumed) >= msg.max_tokens:
        raise RequestRejected(f"resumed_token_ids ({len(resumed)} tokens) must be fewer than max_tokens ({msg.max_tokens})",
                              "resumed_token_ids")
    bad = next((t for t in resumed if t >= vocab_size), None)
    if bad is not None:
        raise RequestRejected(f"resumed token id {bad} is outside the vocabulary (0..{vocab_size - 1})", "resumed_token_ids")
    if msg.prompt_logprobs is not None:
        raise RequestRejected("a resumed request cannot ask for prompt_logprobs: they came with its first token", "prompt_logprobs")
