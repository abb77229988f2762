"""The KV cache's memory: sizing it (the profile run, the device budget), allocating it, its blocks' bytes, and the offload tier's copies."""
