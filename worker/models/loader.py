"""From a checkpoint directory to a ``DecoderModel``: checkpoint names to fused weights.

The table is vLLM's ``stacked_params_mapping``: q_proj, k_proj, v_proj become one qkv
projection (rows concatenated in that order) and gate_proj, up_proj one gate_up. Every
tensor's shape is checked against config.json before it is used; a tied lm_head is the
embedding itself. Gemma's norm weights w become 1 + w in float32 (``gemma_rms_norm``).

With a ``TPShard`` (tensor parallelism) each rank reads only its slices
(``worker/parallel/linear.py``: ``shard_spec``), fused the same way; o_proj and down_proj
become row-parallel around the group's all-reduce.
"""

from __future__ import annotations

import torch

from worker.load.checkpoint import Checkpoint, CheckpointError
from worker.models.config import ModelConfig, model_config_from_hf
from worker.models.decoder import DecoderLayer, DecoderModel
from worker.models.gemm import gemm_dtype
from worker.models.layers import ACTIVATION_FNS, GatedMLP, Linear, make_linear
from worker.parallel.linear import AllReduce, RowParallelLinear, TPShard, narrowed_shape, shard_spec

# fused name -> the checkpoint's parts, concatenated along dim 0
STACKED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}


def expected_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor kvpool reads, by checkpoint name, with its shape."""
    H, V, inter, hd = c.hidden_size, c.vocab_size, c.intermediate_size, c.head_dim
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,)}
    if not c.tie_word_embeddings:
        shapes["lm_head.weight"] = (V, H)
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        attn = {"q_proj": c.q_size, "k_proj": c.kv_size, "v_proj": c.kv_size}
        for name, out in attn.items():
            shapes[f"{p}self_attn.{name}.weight"] = (out, H)
            if c.qkv_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (out,)
        shapes[f"{p}self_attn.o_proj.weight"] = (H, c.q_size)
        if c.o_bias:
            shapes[f"{p}self_attn.o_proj.bias"] = (H,)
        if c.qk_norm:
            shapes[f"{p}self_attn.q_norm.weight"] = (hd,)
            shapes[f"{p}self_attn.k_norm.weight"] = (hd,)
        shapes[f"{p}mlp.gate_proj.weight"] = (inter, H)
        shapes[f"{p}mlp.up_proj.weight"] = (inter, H)
        shapes[f"{p}mlp.down_proj.weight"] = (H, inter)
        shapes[f"{p}input_layernorm.weight"] = (H,)
        shapes[f"{p}post_attention_layernorm.weight"] = (H,)
        if c.gemma:
            shapes[f"{p}pre_feedforward_layernorm.weight"] = (H,)
            shapes[f"{p}post_feedforward_layernorm.weight"] = (H,)
    return shapes


def _stacked(w: dict[str, torch.Tensor], prefix: str, fused: str, suffix: str) -> torch.Tensor | None:
    parts = [f"{prefix}{name}.{suffix}" for name in STACKED[fused]]
    if parts[0] not in w:
        return None
    return torch.cat([w.pop(p) for p in parts])


def _layer(w: dict[str, torch.Tensor], c: ModelConfig, i: int, all_reduce: AllReduce | None, compute: torch.dtype) -> DecoderLayer:
    """Layer i from checked tensors; with ``all_reduce``, this rank's slices (already
    narrowed as ``shard_spec`` says) with o and down row-parallel around it. Projections
    run in ``compute`` (``worker.models.gemm``)."""
    p = f"model.layers.{i}."
    a, m = f"{p}self_attn.", f"{p}mlp."

    def col(weight: torch.Tensor, bias: torch.Tensor | None = None) -> Linear:
        return make_linear(weight, bias, compute)

    def row(weight: torch.Tensor, bias: torch.Tensor | None) -> Linear | RowParallelLinear:
        if all_reduce is None:
            return col(weight, bias)
        out = None if compute == weight.dtype else weight.dtype
        return RowParallelLinear(weight.to(compute), bias, all_reduce, out)

    def norm(name: str) -> torch.Tensor | None:
        weight = w.pop(name, None)
        return weight if weight is None or not c.gemma else 1.0 + weight.float()

    return DecoderLayer(
        input_norm=norm(f"{p}input_layernorm.weight"),
        qkv=col(_stacked(w, a, "qkv_proj", "weight"), _stacked(w, a, "qkv_proj", "bias")),
        o=row(w.pop(f"{a}o_proj.weight"), w.pop(f"{a}o_proj.bias", None)),
        post_attention_norm=norm(f"{p}post_attention_layernorm.weight"),
        mlp=GatedMLP(col(_stacked(w, m, "gate_up_proj", "weight")), row(w.pop(f"{m}down_proj.weight"), None), ACTIVATION_FNS[c.hidden_act]),
        q_norm=norm(f"{a}q_norm.weight"),
        k_norm=norm(f"{a}k_norm.weight"),
        pre_feedforward_norm=norm(f"{p}pre_feedforward_layernorm.weight"),
        post_feedforward_norm=norm(f"{p}post_feedforward_layernorm.weight"),
        local_rope=c.local_rope is not None and c.layer_windows[i] > 0,
    )


def build_decoder(
    config: ModelConfig, w: dict[str, torch.Tensor], shard: TPShard | None = None, all_reduce: AllReduce | None = None
) -> DecoderModel:
    """The model from checked tensors (``w`` is consumed); with ``shard``, this rank's part."""
    sharded = shard is not None and shard.size > 1
    if sharded and all_reduce is None:
        raise ValueError("a sharded model needs the group's all_reduce")
    embed = w.pop("model.embed_tokens.weight")
    compute = gemm_dtype(embed.dtype, embed.device)
    layers = [_layer(w, config, i, all_reduce if sharded else None, compute) for i in range(config.num_layers)]
    lm_head = embed if config.tie_word_embeddings else w.pop("lm_head.weight")
    norm = w.pop("model.norm.weight")
    if config.gemma:
        norm = 1.0 + norm.float()
    return DecoderModel(config, embed, layers, norm, lm_head, shard if sharded else None)


def load_model(
    checkpoint: Checkpoint, dtype: torch.dtype, device: torch.device | str, config: ModelConfig | None = None,
    shard: TPShard | None = None, all_reduce: AllReduce | None = None,
) -> DecoderModel:
    """Read, check and assemble. Raises CheckpointError (or ModelConfigError) naming
    the file and tensor at fault."""
    if config is None:
        config = model_config_from_hf(checkpoint.config, checkpoint.generation_config, str(checkpoint.config_path))
    shapes = expected_shapes(config)
    narrow = shard_spec(config, shard) if shard is not None and shard.size > 1 else {}
    weights = checkpoint.load(list(shapes), dtype, device, narrow)
    for name, shape in shapes.items():
        if checkpoint.shapes[name] != shape:
            file = checkpoint.tensor_files[name]
            raise CheckpointError(f"{file}: tensor {name!r} has shape {checkpoint.shapes[name]}, config.json says {shape}")
        # NOTE: holds once the whole shape is right: every slice then fits.
        assert tuple(weights[name].shape) == narrowed_shape(shape, narrow.get(name))
    return build_decoder(config, weights, shard, all_reduce)
