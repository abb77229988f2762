"""Which free cached blocks stay: the eviction policies of ``--kv-eviction-policy`` (arc,
lfu, lru, s3fifo, cost) over the policy free queue, retention by request priority, and
pinned prefixes."""
