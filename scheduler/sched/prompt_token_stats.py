"""PromptTokenStats: the prompt tokens of requests at their first token, by source.

vLLM's PromptTokenStats, kept cumulative: each request counts once, when its first
token is sampled, with what its first admission found in the cache (vLLM's
PrefillStats, set at first scheduling and folded in at the first output). So

    computed + local_cache_hit + external_kv_transfer == total    (vllm:prompt_tokens)

holds at every step, prefix caching on or off (off, nothing is ever a hit).
"""

from __future__ import annotations

from dataclasses import dataclass

from scheduler.sched.request import Request


@dataclass(slots=True)
class PromptTokenStats:
    # Prompt tokens (cached ones included), as vllm:prompt_tokens counts them.
    total: int = 0
    # Found in the device's prefix cache at first admission.
    local_cache_hit: int = 0
    # Loaded from the host tier at first admission (vLLM's KV connector).
    external_kv_transfer: int = 0

    def record(self, request: Request) -> None:
        """``request`` got its first token (called once per request)."""
        external = request.num_external_cached_tokens
        self.total += request.num_prompt_tokens
        self.local_cache_hit += request.num_cached_tokens - external
        # NOTE: as vLLM's PrefillStats, set when the load was planned: a token loaded and computed again counts as loaded.
        self.external_kv_transfer += external + request.num_replay_tokens

    @property
    def computed(self) -> int:
        """Prefilled by the worker (vLLM's ``local_compute``)."""
        return self.total - self.local_cache_hit - self.external_kv_transfer

    @property
    def cached_tokens(self) -> int:
        return self.local_cache_hit + self.external_kv_transfer
