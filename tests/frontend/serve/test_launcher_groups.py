"""``kvpool serve`` and KV-cache groups: the pool's bytes per block counted over the
worker's KV tensors (worked by hand), and vLLM's --disable-hybrid-kv-cache-manager and
--disable-sliding-window handed to the worker."""

from __future__ import annotations

import json

from bench.kv_block_bytes import kv_bytes_per_block
from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher

# 2 KV heads of 32 dims, float32, blocks of 16 tokens: one layer's block is
# 2 (K, V) x 16 x 2 x 32 x 4 bytes = 8192.
LAYER_BLOCK = 2 * 16 * 2 * 32 * 4
BASE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32",
        "max_position_embeddings": 8192}


def write(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return tmp_path


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


def built(argv: list[str], model: str) -> dict[str, list[str]]:
    la = Launcher(parse_serve(["serve", model, *argv]), log=lambda *a, **k: None)
    la.build()
    return {name: c.argv for name, c in la.children.items()}


def test_the_flags_reach_the_worker_only(tmp_path):
    d = str(write(tmp_path, num_hidden_layers=2, sliding_window=512))
    plain = built([], d)
    both = built(["--disable-hybrid-kv-cache-manager", "--disable-sliding-window"], d)
    for flag in ("--disable-hybrid-kv-cache-manager", "--disable-sliding-window"):
        assert flag in both["worker"] and flag not in plain["worker"]
        assert flag not in both["scheduler"] and flag not in both["frontend"]
    assert "--disable-hybrid-kv-cache-manager" not in built(["--no-disable-hybrid-kv-cache-manager"], d)["worker"]
