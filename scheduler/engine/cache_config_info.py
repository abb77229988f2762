"""vllm:cache_config_info's labels: vLLM 0.32's CacheConfig.metrics_info(), filled from kvpool.

vLLM exports its CacheConfig as a gauge set to 1 whose labels are every field of
the config, as strings, in the config's order, then ``engine``. kvpool gives the
same label names: its own value where kvpool has the setting, vLLM's default
where the setting is of a feature kvpool does not have (mamba state, KV sharing,
...), and "None" where only the worker knows it (gpu_memory_utilization,
kv_cache_memory_bytes) or the scheduler cannot tell (user_specified_block_size: its
--block-size has a default). cache_dtype is the --kv-cache-dtype name as given, as
vLLM's (fp8 stays "fp8").
"""

from __future__ import annotations

from scheduler.engine.config import SchedulerConfig

# vLLM 0.32's CacheConfig fields, in order, with its defaults (CacheConfig().metrics_info()).
VLLM_CACHE_CONFIG_DEFAULTS: dict[str, str] = {
    "block_size": "16", "user_specified_block_size": "False", "kv_cache_layout": "None", "prefix_match_unit": "None",
    "gpu_memory_utilization": "0.92", "cache_dtype": "auto", "is_attention_free": "False", "num_gpu_blocks_override": "None",
    "sliding_window": "None", "enable_prefix_caching": "True", "prefix_caching_hash_algo": "sha256",
    "prefix_cache_retention_interval": "0", "kv_cache_dtype_skip_layers": "[]", "mamba_page_size_padded": "None",
    "skip_page_size_padded": "None", "mamba_block_size": "None", "mamba_cache_dtype": "auto", "mamba_ssm_cache_dtype": "auto",
    "mamba_cache_mode": "none", "enable_mamba_shared_prefix_checkpoint": "False", "replayssm_buffer_len": "16",
    "use_replayssm": "False", "use_kda_recoverssm": "False", "num_gpu_blocks": "None", "num_cpu_blocks": "None",
    "effective_attention_block_size": "None", "kv_cache_size_tokens": "None", "kv_cache_max_concurrency": "None",
    "hash_block_size": "None", "cache_hit_alignment_tokens": "None", "kv_sharing_fast_prefill": "False",
    "swa_bounded_replay": "True", "kv_cache_memory_bytes": "None", "kv_offloading_size": "None",
    "kv_offloading_backend": "native", "_block_size_resolved": "True",
}


def cache_config_info(config: SchedulerConfig, num_gpu_blocks: int) -> dict[str, str]:
    """The labels of vllm:cache_config_info but ``engine``, once the pool has ``num_gpu_blocks``."""
    info = dict(VLLM_CACHE_CONFIG_DEFAULTS)
    # As vLLM's get_kv_cache_capacity for one full-attention group: requests of
    # max_model_len the pool holds at once, and the tokens they make.
    max_concurrency = num_gpu_blocks / -(-config.max_model_len // config.block_size)
    info.update(
        effective_attention_block_size=str(config.block_size),
        kv_cache_max_concurrency=str(max_concurrency),
        kv_cache_size_tokens=str(int(max_concurrency * config.max_model_len)),
        block_size=str(config.block_size),
        cache_dtype=config.kv_cache_dtype,
        user_specified_block_size="None",
        gpu_memory_utilization="None",
        num_gpu_blocks_override=str(config.num_gpu_blocks_override),
        enable_prefix_caching=str(config.enable_prefix_caching),
        prefix_caching_hash_algo=config.prefix_caching_hash_algo,
        num_gpu_blocks=str(num_gpu_blocks),
        kv_offloading_size=str(config.kv_offloading_size) if config.kv_offloading_size > 0 else "None",
    )
    return info
