"""vLLM 0.32's own grouping of layers into KV-cache groups, for
tests/protocol/test_kv_cache_groups_vllm.py (``-m compare``); run with the vLLM venv:

    .venv-vllm/bin/python tests/protocol/data/vllm_kv_cache_groups.py '{"name": [windows...], ...}'

For each pattern (a layer's sliding window, 0 for full attention) prints its groups
(layer indices and window, in vLLM's order) and the blocks' bytes over one layer's
page: the number of KV tensors a block spans (vLLM's layer-outermost layout); or the
ValueError vLLM raises."""

import json
import sys
import types

import torch
import vllm.v1.core.kv_cache_utils as kcu
from vllm.config.cache import _layout_from_name
from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

KW = {"block_size": 16, "num_kv_heads": 2, "head_size": 8, "dtype": torch.float32}
LAYOUT = _layout_from_name("LBHNC")


def spec(window: int):
    return (
        FullAttentionSpec(**KW) if window == 0 else SlidingWindowSpec(**KW, sliding_window=window)
    )


def groups_of(windows: list[int], disable_hybrid: bool) -> dict:
    try:
        return _groups_of(windows, disable_hybrid)
    except ValueError as e:
        return {"error": str(e)}


def _groups_of(windows: list[int], disable_hybrid: bool) -> dict:
    config = types.SimpleNamespace(
        scheduler_config=types.SimpleNamespace(disable_hybrid_kv_cache_manager=disable_hybrid),
        attention_config=types.SimpleNamespace(hisparse_config=None),
        speculative_config=None,
        cache_config=types.SimpleNamespace(get_resolved_kv_cache_layout=lambda: LAYOUT),
    )
    specs = {f"model.layers.{i}.self_attn.attn": spec(w) for i, w in enumerate(windows)}
    groups = kcu.get_kv_cache_groups(config, specs)
    page = spec(0).page_size_bytes
    out = []
    for g in groups:
        s = g.kv_cache_spec
        out.append(
            [
                [int(n.split(".")[2]) for n in g.layer_names],
                s.sliding_window if isinstance(s, SlidingWindowSpec) else 0,
            ]
        )
    return {
        "groups": out,
        "num_kv_tensors": kcu._get_kv_cache_bytes_per_block(groups, LAYOUT) // page,
    }


patterns = json.loads(sys.argv[1])
print(json.dumps({name: [groups_of(w, False), groups_of(w, True)] for name, w in patterns.items()}))
