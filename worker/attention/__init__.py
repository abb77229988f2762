"""Attention over the paged KV cache: the cache write, the per-step metadata, and the shared-prefix (cascade) path."""
