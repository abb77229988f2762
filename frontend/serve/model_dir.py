"""What a checkpoint folder must hold for `kvpool serve` to start: checked before any
process starts, so a wrong folder is one clear line, not a child's traceback later.

The worker reads the weights and refuses a bad tensor by name; this is only the first
look a person needs: the folder, config.json, safetensors weights, tokenizer.json.
"""

from __future__ import annotations

from pathlib import Path

from frontend.checkpoint_config import read_config_json

_NEEDS = "a checkpoint folder needs config.json, *.safetensors and tokenizer.json"


def checkpoint_problem(model: str, model_dir: Path) -> str | None:
    """What makes ``model_dir`` unservable, in one line naming ``model`` as given, or None."""
    if not model_dir.is_dir():
        return f"{model} is not a checkpoint folder"
    try:
        config = read_config_json(model_dir)
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
