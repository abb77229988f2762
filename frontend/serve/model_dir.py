"""What a checkpoint folder must hold for `kvpool serve` to start: checked before any
process starts, so a wrong folder is one clear line, not a child's traceback later.

The worker reads the weights and refuses a bad tensor by name; this is only the first
look a person needs: the folder, config.json, safetensors weights, tokenizer.json.
"""

from __future__ import annotations

import json
from pathlib import Path

_NEEDS = "a checkpoint folder needs config.json, *.safetensors and tokenizer.json"


def config_json(model_dir: Path) -> object:
    """The checkpoint's config.json, parsed: the one place kvpool serve reads it. Raises
    OSError (no file, unreadable) or ValueError (not JSON)."""
    return json.loads((Path(model_dir) / "config.json").read_text())


def checkpoint_problem(model: str, model_dir: Path) -> str | None:
    """What makes ``model_dir`` unservable, in one line naming ``model`` as given, or None."""
    if not model_dir.is_dir():
        return f"{model} is not a checkpoint folder"
    try:
        config = config_json(model_dir)
    except FileNotFoundError:
        return f"{model}: no config.json ({_NEEDS})"
    except (OSError, ValueError) as e:
        return f"{model}: config.json is not readable JSON ({e})"
    if not isinstance(config, dict):
        return f"{model}: config.json is not a JSON object"
    if not any(model_dir.glob("*.safetensors")) and not (model_dir / "model.safetensors.index.json").is_file() \
            and not any(model_dir.glob("*.gguf")):
        return f"{model}: no *.safetensors weights ({_NEEDS})"
    if not (model_dir / "tokenizer.json").is_file():
        return f"{model}: no tokenizer.json ({_NEEDS}; only fast tokenizers are supported)"
    return None


def model_vocab_size(model_dir: str | Path) -> int | None:
    """The model's vocabulary size from config.json (vLLM's ``get_vocab_size``: the text
    config's), the width of its logits; None when the file does not say."""
    try:
        config = config_json(Path(model_dir))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    text = config.get("text_config")
    size = (text if isinstance(text, dict) and "vocab_size" in text else config).get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
