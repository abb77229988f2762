"""An fp8 KV cache's per-tensor scales from the checkpoint, as vLLM 0.32 reads them.

vLLM loads ``k_scale``/``v_scale`` only for a quantized checkpoint (config.json has a
``quantization_config``: its quant method adds the scale parameters to each attention
layer); an unquantized checkpoint's scale tensors, if any, find no parameter and are
skipped, so its scales are 1.0. The names it maps onto a layer's ``attn.k_scale``
(``maybe_remap_kv_scale_name``) are the ones read here; the deprecated ``kv_scale`` is K's.
"""

from __future__ import annotations

import torch

from worker.attention.kv_quant import KVScales, checkpoint_kv_scales
from worker.load.checkpoint import Checkpoint, CheckpointError

# Where a layer's K (or V) scale may be, after "model.layers.{i}.self_attn.".
_NAMES = {
    "k": ("attn.k_scale", "k_proj.k_scale", "qkv_proj.k_scale", "kv_scale"),
    "v": ("attn.v_scale", "v_proj.v_scale", "qkv_proj.v_scale"),
}


def read_kv_scales(checkpoint: Checkpoint, num_layers: int) -> list[KVScales]:
    """Per layer, its K and V scales (1.0 where vLLM would use 1.0)."""
    if "quantization_config" not in checkpoint.config:
        return [KVScales()] * num_layers
    found: dict[str, str] = {}  # name in the checkpoint -> "{layer}.{k|v}"
    for i in range(num_layers):
        for which, suffixes in _NAMES.items():
            names = [f"model.layers.{i}.self_attn.{s}" for s in suffixes if f"model.layers.{i}.self_attn.{s}" in checkpoint.tensor_files]
            if names:
                found[names[0]] = f"{i}.{which}"
    values = {}
    for name, tensor in checkpoint.load(list(found), torch.float32, "cpu").items():
        if tensor.numel() != 1:
            raise CheckpointError(f"{checkpoint.tensor_files[name]}: {name!r} has shape {tuple(tensor.shape)}: "
                                  "only a per-tensor scaling factor is supported for an fp8 KV cache")
        scale = float(tensor.reshape(()))
        if not scale > 0.0:
            raise CheckpointError(f"{checkpoint.tensor_files[name]}: {name!r} is {scale}: a KV cache scale must be positive")
        values[found[name]] = scale
    return [checkpoint_kv_scales(values.get(f"{i}.k"), values.get(f"{i}.v")) for i in range(num_layers)]
