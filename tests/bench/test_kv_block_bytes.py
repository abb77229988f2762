"""The bytes of one KV block worked out from a checkpoint's config.json
(bench/kv_block_bytes.py), by hand: every layer, or a hybrid model's KV tensors."""

from __future__ import annotations

import json

from bench.kv_block_bytes import kv_bytes_per_block

# 2 KV heads of 32 dims, float32, blocks of 16 tokens: one layer's block is
# 2 (K, V) x 16 x 2 x 32 x 4 bytes = 8192.
LAYER_BLOCK = 2 * 16 * 2 * 32 * 4
BASE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32",
        "max_position_embeddings": 8192}


def write(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return tmp_path


def test_kv_bytes_per_block_of_the_tiny_checkpoint(tiny_checkpoint):
    # 2 (K, V) x 4 layers x 16 tokens x 2 KV heads x 32 dims x 4 bytes (float32)
    assert kv_bytes_per_block(tiny_checkpoint, 16, "auto") == 2 * 4 * 16 * 2 * 32 * 4
    assert kv_bytes_per_block(tiny_checkpoint, 16, "bfloat16") == 2 * 4 * 16 * 2 * 32 * 2
    # fp8: one byte an element, whatever the model's dtype.
    assert kv_bytes_per_block(tiny_checkpoint, 16, "auto", 1, "fp8") == 2 * 4 * 16 * 2 * 32 * 1
    assert kv_bytes_per_block(tiny_checkpoint, 16, "bfloat16", 1, "fp8_e5m2") == 2 * 4 * 16 * 2 * 32 * 1


def test_one_window_on_every_layer_is_one_group_of_every_layer(tmp_path):
    # Mistral with a window: one sliding group, a tensor per layer, as a full-attention model.
    d = write(tmp_path, num_hidden_layers=6, sliding_window=512)
    assert kv_bytes_per_block(d, 16, "auto") == 6 * LAYER_BLOCK
    assert kv_bytes_per_block(d, 16, "auto", disable_hybrid=True) == 6 * LAYER_BLOCK
    assert kv_bytes_per_block(d, 16, "auto", disable_sliding_window=True) == 6 * LAYER_BLOCK


def test_gemma3_pattern_is_sized_by_its_kv_tensors(tmp_path):
    types = ["sliding_attention"] * 5 + ["full_attention"]
    d = write(tmp_path, architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", num_hidden_layers=6, sliding_window=512,
              layer_types=types)
    # Windows [512 x5, 0]: 5 sliding groups and 1 full group of one layer each, so ONE
    # tensor: a block costs one layer. Without hybrid groups every layer is kept: six.
    assert kv_bytes_per_block(d, 16, "auto") == 1 * LAYER_BLOCK
    assert kv_bytes_per_block(d, 16, "auto", disable_hybrid=True) == 6 * LAYER_BLOCK
    assert kv_bytes_per_block(d, 16, "auto", disable_sliding_window=True) == 6 * LAYER_BLOCK


def test_an_unknown_dtype_has_no_size(tmp_path):
    assert kv_bytes_per_block(write(tmp_path, num_hidden_layers=2, torch_dtype="float7"), 16, "auto") is None
