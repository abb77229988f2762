"""What only a model of several KV-cache groups (or one sliding-window group) needs:
vLLM's HybridKVCacheCoordinator, its prefix hit across groups, the pool's events keyed by
group, and what a sliding group retains."""
