"""``GET /tokenizer_info`` with ``--enable-tokenizer-info-endpoint`` (without it the
route does not exist: 404, as vLLM's). vLLM answers its tokenizer's ``init_kwargs``
as transformers 5 builds them from the checkpoint's ``tokenizer_config.json``, file
paths and the flags transformers consumes dropped, special tokens by their text,
``added_tokens_decoder`` as {id: text}, then what its loader adds; first
``tokenizer_class``, its tokenizer's class name (transformers' class wrapped twice:
``TokenizerPoolCachedTokenizersBackend`` for a generic tokenizer.json,
``TokenizerPoolCachedQwen2Tokenizer`` for a qwen2 one), and the chat template in use.
"""

from __future__ import annotations

import json
from pathlib import Path

from aiohttp import web

from frontend.openai.serving import json_response
from frontend.text.tokenizer import Tokenizer

# NOTE: vLLM's name for its tokenizer: its tokenizer pool's wrapper of its cached
# wrapper of transformers' class ("TokenizersBackend" for a generic tokenizer.json).
TOKENIZER_CLASS = "TokenizerPoolCached{}"
# tokenizer_config.json keys absent from vLLM's answer: file paths (vLLM drops them)
# and what transformers 5 reads into the tokenizer rather than keeping.
_DROPPED = ("vocab_file", "merges_file", "tokenizer_file", "tokenizer_class", "add_bos_token", "add_eos_token", "added_tokens_decoder")


def _text(value):
    """An AddedToken as transformers serialises it ({"content": ...}) by its text, as vLLM's ``_make_json_serializable``."""
    if isinstance(value, dict):
        return value["content"] if isinstance(value.get("content"), str) else {k: _text(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text(v) for v in value]
    return value


def _read(path: Path) -> dict:
    data = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    return data if isinstance(data, dict) else {}


def tokenizer_info(model_dir: str, chat_template: str | None, tokenizer_class: str = "TokenizersBackend") -> dict:
    d = Path(model_dir)
    config = _read(d / "tokenizer_config.json")
    added = config.get("added_tokens_decoder")
    if not isinstance(added, dict):  # NOTE: transformers takes them from tokenizer.json then
        tokens = _read(d / "tokenizer.json").get("added_tokens") or []
        added = {str(t["id"]): t for t in tokens if isinstance(t, dict) and "id" in t}
    info = {"tokenizer_class": TOKENIZER_CLASS.format(tokenizer_class), **{k: _text(v) for k, v in config.items() if k not in _DROPPED}}
    if chat_template is not None:
        info["chat_template"] = chat_template
    # NOTE: what vLLM's loader adds: left truncation, the local folder, the tokenizers backend.
    info.update(truncation_side="left", name_or_path=model_dir, is_local=True, local_files_only=True,
                added_tokens_decoder={k: _text(v) for k, v in added.items()}, backend="tokenizers")
    return info


def tokenizer_info_routes(enabled: bool, model_dir: str, tokenizer: Tokenizer) -> list[tuple]:
    """The route with --enable-tokenizer-info-endpoint (``enabled``), else none."""
    if not enabled:
        return []
    info = tokenizer_info(model_dir, tokenizer.chat_template, type(tokenizer.hf).__name__)

    async def get_tokenizer_info(_request: web.Request) -> web.Response:
        return json_response(info)

    return [("GET", "/tokenizer_info", get_tokenizer_info)]
