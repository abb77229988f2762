"""The KV-cache core, as vLLM keeps it in ``vllm/v1/core/``: blocks, the free queue,
the prefix-cache map, the pool, block hashing, the KV cache manager over its
coordinator, the single-type managers and the event-sink interface. Imports nothing of
the project but ``protocol/``.

Rooms beside that root: ``hybrid/`` (what only several KV-cache groups need: the hybrid
coordinator, its cache hit, group-keyed events, sliding-window retention),
``retention/`` (the free cached blocks' eviction policies, pins, priority retention),
``offload/`` (the host tier, the external tier, the offloading connector)."""
