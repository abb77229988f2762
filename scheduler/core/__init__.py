"""The KV-cache core, as vLLM keeps it in ``vllm/v1/core/``: blocks, the free queue,
the prefix-cache map, the pool, block hashing, the KV cache manager and the event-sink
interface. Imports nothing of the project but ``protocol/``."""
