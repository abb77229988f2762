"""protocol/kv_cache_spec.py: the one formula for a KV block's bytes."""

from __future__ import annotations

from protocol.kv_cache_spec import kv_bytes_per_block


def test_a_block_is_k_and_v_of_its_tokens_in_every_layer():
    # 2 (K, V) x 4 layers x 16 tokens x 2 KV heads x 32 dims x 4 bytes.
    assert kv_bytes_per_block(4, 16, 2, 32, 4) == 2 * 4 * 16 * 2 * 32 * 4
    assert kv_bytes_per_block(4, 32, 2, 32, 4) == 2 * kv_bytes_per_block(4, 16, 2, 32, 4)


def test_disable_hybrid_refuses_several_windows_as_vllm():
    import pytest

    from protocol.kv_cache_spec import kv_cache_groups

    # One window and full layers: one full group of every layer.
    assert [
        (g.layer_ids, g.sliding_window) for g in kv_cache_groups([8, 0, 8], disable_hybrid=True)
    ] == [([0, 1, 2], 0)]
    with pytest.raises(ValueError, match="--disable-hybrid-kv-cache-manager"):
        kv_cache_groups([8, 0, 16], disable_hybrid=True)
