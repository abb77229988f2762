"""``kvpool serve`` and KV-cache groups: vLLM's --disable-hybrid-kv-cache-manager and
--disable-sliding-window handed to the worker (the bytes per block over its KV tensors:
tests/bench/test_kv_block_bytes.py)."""

from __future__ import annotations

import json

from frontend.serve.cli import parse_serve
from frontend.serve.launcher import Launcher

BASE = {"hidden_size": 256, "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "torch_dtype": "float32",
        "max_position_embeddings": 8192}


def write(tmp_path, **cfg):
    (tmp_path / "config.json").write_text(json.dumps({**BASE, **cfg}))
    return tmp_path


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
