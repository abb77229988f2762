"""vLLM's single-type managers: kvpool's, with vLLM's keyword names and call shapes.

kvpool's managers take vLLM's constructor shape (kv_cache_spec, block_pool,
enable_caching, kv_cache_group_id); what vLLM adds and kvpool lacks (speculative
lookahead tokens, external computed tokens, KV zeroing, eagle, hashes finer than a
block) is refused with NotMapped when asked for, and passed through when it is the
no-op value.
"""

from __future__ import annotations

from scheduler.core import single_type_kv_cache_manager as kvpool
from vllm.unmapped import module_getattr, refuse

__getattr__ = module_getattr(__name__)


class VllmShapes:
    """vLLM's method shapes over a kvpool manager (mixed in before it)."""

    def __init__(self, kv_cache_spec, block_pool, enable_caching: bool = True, kv_cache_group_id: int = 0,
                 scheduler_block_size: int | None = None, needs_kv_cache_zeroing: bool = False,
                 max_admission_blocks_per_request: int | None = None, dcp_world_size: int = 1,
                 pcp_world_size: int = 1, **kwargs):
        if kwargs:
            refuse(f"{type(self).__name__}({', '.join(kwargs)})")
        if needs_kv_cache_zeroing:
            refuse("needs_kv_cache_zeroing (kvpool's worker never zeroes new blocks)")
        if dcp_world_size != 1 or pcp_world_size != 1:
            refuse("decode/prefill context parallelism")
        if scheduler_block_size not in (None, kv_cache_spec.block_size):
            refuse("a scheduler block size other than the group's")
        super().__init__(kv_cache_spec, block_pool, enable_caching, kv_cache_group_id)
        self.max_admission_blocks_per_request = max_admission_blocks_per_request

    def get_num_blocks_to_allocate(self, request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                   num_local_computed_tokens=0, num_tokens_main_model=None):
        if num_tokens_main_model not in (None, num_tokens):
            refuse("lookahead (speculative) tokens")
        return super().get_num_blocks_to_allocate(request_id, num_tokens, new_computed_blocks, total_computed_tokens,
                                                  self.max_admission_blocks_per_request)

    def add_local_computed_blocks(self, request_id, new_computed_blocks, num_local_computed_tokens,
                                  num_external_computed_tokens=0):
        if num_external_computed_tokens:
            refuse("external computed tokens in the single-type manager")
        return super().add_local_computed_blocks(request_id, new_computed_blocks, num_local_computed_tokens)

    def allocate_new_blocks(self, request_id, num_tokens, num_tokens_main_model=None):
        if num_tokens_main_model not in (None, num_tokens):
            refuse("lookahead (speculative) tokens")
        return super().allocate_new_blocks(request_id, num_tokens)

    def remove_skipped_blocks(self, request_id, num_computed_tokens, num_prompt_tokens=None):
        if num_prompt_tokens is not None:
            refuse("remove_skipped_blocks(num_prompt_tokens=): R-SWA")
        return super().remove_skipped_blocks(request_id, num_computed_tokens)

    @classmethod
    def find_longest_cache_hit(cls, block_hashes, max_length, kv_cache_group_ids, block_pool, kv_cache_spec,
                               drop_eagle_block=False, alignment_tokens=None, **kwargs):
        if kwargs:
            refuse(f"find_longest_cache_hit({', '.join(kwargs)})")
        if drop_eagle_block:
            refuse("eagle")
        if alignment_tokens not in (None, kv_cache_spec.block_size):
            refuse("hashes finer than a block (hash_block_size < block_size)")
        computed, hit_length = super().find_longest_cache_hit(
            block_hashes, max_length, list(kv_cache_group_ids), block_pool, kv_cache_spec.block_size,
            kv_cache_spec.sliding_window)
        return tuple(computed), hit_length


class FullAttentionManager(VllmShapes, kvpool.FullAttentionManager):
    pass


class SlidingWindowManager(VllmShapes, kvpool.SlidingWindowManager):
    pass
