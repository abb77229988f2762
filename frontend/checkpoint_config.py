"""The checkpoint's config.json, read in one place for the frontend's two processes:

* the API server reads it once, at start (``checkpoint_config``), and hands each user
  what it needs: the tokenizer its ``model_type`` (a few load as the generic backend),
  the token-id checks its ``vocab_size``, the answers' system_fingerprint its bytes;
* ``kvpool serve`` checks the folder and settles the flags from it (``read_config_json``,
  frontend/serve/model_dir.py and settle.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


def read_config_json(model_dir: str | Path) -> object:
    """``model_dir``/config.json, parsed. Raises OSError (no file, unreadable) or
    ValueError (not JSON)."""
    return json.loads(_config_bytes(model_dir))


def _config_bytes(model_dir: str | Path) -> bytes:
    return (Path(model_dir) / "config.json").read_bytes()


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    """What the API server takes from config.json (each None, and ``text`` empty, when
    the file is missing or does not say)."""

    text: bytes  # the file as it is: hashed into the answers' system_fingerprint
    model_type: str | None
    vocab_size: int | None  # vLLM's ``get_vocab_size``: the text config's, the width of the logits


def checkpoint_config(model_dir: str | Path) -> CheckpointConfig:
    """The API server's one read of ``model_dir``/config.json."""
    try:
        text = _config_bytes(model_dir)
        config = json.loads(text)
    except OSError:
        return CheckpointConfig(b"", None, None)
    except ValueError:
        return CheckpointConfig(text, None, None)
    if not isinstance(config, dict):
        return CheckpointConfig(text, None, None)
    model_type = config.get("model_type")
    return CheckpointConfig(text, model_type if isinstance(model_type, str) else None, _vocab_size(config))


def _vocab_size(config: dict) -> int | None:
    text = config.get("text_config")
    size = (text if isinstance(text, dict) and "vocab_size" in text else config).get("vocab_size")
    return size if isinstance(size, int) and not isinstance(size, bool) and size > 0 else None
