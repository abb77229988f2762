"""A checkpoint's tokenizer, read the way transformers' ``AutoTokenizer`` reads it,
with the ``tokenizers`` library alone (no transformers, no torch).

* ``tokenizer.json`` is the tokenizer; its post-processor decides which special
  tokens ``add_special_tokens=True`` adds. NOTE: transformers 5 drops
  ``add_bos_token``/``add_eos_token`` from ``tokenizer_config.json`` whenever a
  ``tokenizer.json`` exists, so they are ignored here too: prompts tokenize to exactly
  what vLLM (which uses transformers) gets.
* ``tokenizer_config.json`` names the special tokens (``bos_token``, ``eos_token``,
  ...), added to the vocabulary as special when missing, as transformers does.
* The chat template comes from ``chat_template.jinja`` (where transformers 5 writes
  it), else the config's ``chat_template`` key (a string, or a list of named ones:
  "default" is taken).
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A checkpoint folder whose tokenizer files are missing or unreadable."""


def _token_content(value) -> str | None:
    if isinstance(value, dict):  # an AddedToken serialised by transformers
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class Tokenizer:
    """Encode, decode and the special tokens of one checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        path = d / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"{d} has no tokenizer.json (only fast tokenizers are supported)")
        try:
            self.backend = HFTokenizer.from_file(str(path))
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            raise TokenizerError(f"{path} is not a readable tokenizer: {e}") from None
        config = _read_json(d / "tokenizer_config.json")
        self.special_tokens_map: dict[str, str] = {}
        for name in SPECIAL_TOKEN_NAMES:
            content = _token_content(config.get(name))
            if content is not None:
                self.special_tokens_map[name] = content
        missing = [t for t in self.special_tokens_map.values() if self.backend.token_to_id(t) is None]
        if missing:
            self.backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
        self.chat_template = _chat_template(d, config)
        self.model_max_length = config.get("model_max_length")

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (``len(tokenizer)``)."""
        return self.backend.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Every token's id, added tokens included (transformers' ``get_vocab``)."""
        return self.backend.get_vocab(with_added_tokens=True)

    def token_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_id("eos_token")

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_batch(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        return [e.ids for e in self.backend.encode_batch(texts, add_special_tokens=add_special_tokens)]

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def token_text(self, token_id: int) -> str:
        """One token as vLLM shows it in logprobs: the token decoded on its own."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [self.backend.id_to_token(i) or "" for i in token_ids]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} is not readable JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return data


def _chat_template(d: Path, config: dict) -> str | None:
    jinja = d / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8")
    template = config.get("chat_template")
    if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None
