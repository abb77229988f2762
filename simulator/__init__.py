"""Offline what-if replays through the real Scheduler, KVCacheManager and BlockPool,
with what-if free policies. May import ``scheduler/`` and ``loadgen/``'s datasets and
arrival schedule."""
