"""vLLM's Request, as far as the core's tests read it: ids, tokens and block hashes.

kvpool's scheduler Request is built from a protocol message; the tests build vLLM's
from keywords, so this is the few fields the core reads (KVCacheRequest's), hashed by
the block hasher the test passes, as vLLM's Request does.
"""

from __future__ import annotations

from vllm.unmapped import module_getattr, refuse

__getattr__ = module_getattr(__name__)


class Request:
    def __init__(self, request_id, prompt_token_ids, sampling_params=None, pooling_params=None, mm_features=None,
                 lora_request=None, cache_salt=None, block_hasher=None, prompt_embeds=None, **kwargs):
        if prompt_token_ids is None:
            refuse("a request of prompt embeddings")
        if kwargs.get("resumable"):
            refuse("resumable requests")
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.all_token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        # Written by kvpool's managers (their decode fast path).
        self.alloc_noop_until = 0
        self.sampling_params = sampling_params
        self.mm_features = mm_features or []
        self.lora_request = lora_request
        self.cache_salt = cache_salt
        self.prompt_embeds = prompt_embeds
        self.spec_token_ids: list[int] = []
        self.block_hashes: list[bytes] = []
        self.block_hasher = block_hasher
        # vLLM's: a request for prompt logprobs must compute every prompt position.
        self.skip_reading_prefix_cache = sampling_params is not None and sampling_params.prompt_logprobs is not None
        self.update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def update_block_hashes(self) -> None:
        if self.block_hasher is not None:
            self.block_hashes.extend(self.block_hasher(self))

    def append_output_token_ids(self, token_ids) -> None:
        self.all_token_ids.extend([token_ids] if isinstance(token_ids, int) else token_ids)
        self.update_block_hashes()
