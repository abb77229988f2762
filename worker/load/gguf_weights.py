"""The weights of a GGUF file (llama.cpp's format) under the names a Hugging Face checkpoint
gives them, dequantized at load, as transformers reads the same file: each tensor through
the ``gguf`` package's ``dequantize`` (every quantization type it knows), then what
llama.cpp's converter did undone (a Llama's Q and K rows un-permuted; Gemma 3's norm
weights less the 1 it added), then cast to the serving dtype.

Names: ``gguf``'s own map from Hugging Face names to GGUF ones for the file's
architecture (``llama``, ``qwen2``, ``qwen3``, ``gemma3``; another is refused by name).
The config comes from the folder ``kvpool serve`` writes beside the file
(``frontend.serve.gguf_model``); this module reads only tensors.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import MODEL_ARCH_NAMES, GGUFReader, dequantize, get_tensor_name_map

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
# A layer's tensors by the names kvpool's loader asks for (``worker.models.loader``).
LAYER_PARTS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm",
               "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "self_attn.q_norm",
               "self_attn.k_norm", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


class GGUFError(ValueError):
    """A GGUF file kvpool cannot serve; the message names the file (and tensor)."""


class GGUFWeights:
    """One GGUF file's tensors by Hugging Face name; ``load`` dequantizes the ones asked."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int):
        self.path = path
        try:
            self.reader = GGUFReader(str(path))
        except (OSError, ValueError) as e:
            raise GGUFError(f"{path}: not a readable GGUF file ({e})") from None
        field = self.reader.fields.get("general.architecture")
        self.architecture = bytes(field.parts[field.data[0]]).decode() if field is not None else "?"
        if self.architecture not in ARCHITECTURES:
            raise GGUFError(f"{path}: GGUF architecture {self.architecture!r} is not served (kvpool serves {', '.join(ARCHITECTURES)})")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        arch = next(k for k, v in MODEL_ARCH_NAMES.items() if v == self.architecture)
        blocks = 1 + max((int(t.name.split(".")[1]) for t in self.reader.tensors if t.name.startswith("blk.")), default=-1)
        self.names = get_tensor_name_map(arch, blocks)
        # GGUF base name -> the Hugging Face one kvpool's loader uses (gguf's map also knows
        # other models' aliases of each, so it is read forward from kvpool's names).
        hf = {self.names.get_name(n): n for n in ("model.embed_tokens", "model.norm", "lm_head")}
        for i in range(blocks):
            for part in LAYER_PARTS:
                hf[self.names.get_name(f"model.layers.{i}.{part}")] = f"model.layers.{i}.{part}"
        hf.pop(None, None)
        self.tensors = {}
        for t in self.reader.tensors:
            base, _, suffix = t.name.rpartition(".")
            if base in hf:
                self.tensors[f"{hf[base]}.{suffix}"] = t

    def index_bytes(self) -> bytes:
        """The tensors' names, types and shapes: what makes two files the same model."""
        return "\n".join(f"{t.name} {t.tensor_type.name} {list(map(int, t.shape))}" for t in self.reader.tensors).encode()

    def load(self, name: str, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """One tensor by its Hugging Face name, dequantized and undone as transformers does."""
        t = self.tensors[name]
        try:
            weights = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise GGUFError(f"{self.path}: tensor {t.name!r} is {t.tensor_type.name}, which the gguf package cannot dequantize ({e})") from None
        weights = self._undo_conversion(t.name, weights)
        return torch.from_numpy(np.copy(weights)).to(dtype=dtype, device=device)

    def _undo_conversion(self, gguf_name: str, weights: np.ndarray) -> np.ndarray:
        """What llama.cpp's converter did to the Hugging Face tensor, undone (transformers'
        LlamaTensorProcessor and Gemma2TensorProcessor)."""
        if self.architecture == "llama" and (".attn_q." in gguf_name or ".attn_k." in gguf_name):
            heads = self.num_heads if ".attn_q." in gguf_name else self.num_kv_heads
            half = weights.shape[0] // heads // 2
            return weights.reshape(heads, half, 2, *weights.shape[1:]).swapaxes(2, 1).reshape(weights.shape)
        if self.architecture == "gemma3" and "norm.weight" in gguf_name:
            return weights - 1
        return weights
