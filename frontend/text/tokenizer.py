"""A checkpoint's tokenizer, loaded exactly as vLLM 0.32's ``get_tokenizer`` loads it:
transformers' ``AutoTokenizer.from_pretrained(folder, trust_remote_code=False,
truncation_side="left")``.

NOTE: not ``tokenizer.json`` read with the ``tokenizers`` library alone: transformers 5
builds some tokenizers from their model type (a ``qwen2`` checkpoint gets Qwen2's
pre-tokenizer, which splits digits one by one, whatever its tokenizer.json carries),
so only transformers' own loading gives the ids vLLM's engine sees.

As vLLM's ``get_cached_tokenizer``, what transformers recomputes on every access (the
special ids, the vocabulary, its length) is read once. As vLLM's renderer, encoding
and chat templates run in a one-thread pool off the event loop (``encode_async``,
``apply_chat_template_async``) on a deep copy of the tokenizer (vLLM's
``maybe_make_thread_pool``): the Rust tokenizer refuses concurrent mutable use, and
the event loop keeps the original for decoding.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# vLLM's _MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS: loaded as the generic
# TokenizersBackend, bypassing the class their tokenizer_config.json names.
MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS = frozenset(("internlm2", "step3_vl", "step3p7", "unlimited-ocr", "unlimited_ocr"))
# transformers' SPECIAL_TOKENS_ATTRIBUTES, in its order.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerError(ValueError):
    """A checkpoint folder whose tokenizer files are missing or unreadable."""


class Tokenizer:
    """Encode, decode, chat templates and the special tokens of one checkpoint folder."""

    def __init__(self, model_dir: str | Path):
        d = Path(model_dir)
        if not (d / "tokenizer.json").is_file():
            raise TokenizerError(f"{d} has no tokenizer.json (only fast tokenizers are supported)")
        # NOTE: imported here, not at the top: transformers takes seconds to import, and
        # `kvpool serve`'s launcher imports this package without ever tokenizing.
        from transformers import AutoTokenizer, TokenizersBackend

        loader = TokenizersBackend if _model_type(d) in MODEL_TYPES_WITH_INCORRECT_TOKENIZER_CLASS else AutoTokenizer
        try:
            # NOTE: vLLM's get_tokenizer kwargs for a generate model (runner "generate").
            hf = loader.from_pretrained(str(d), trust_remote_code=False, truncation_side="left")
        except Exception as e:  # noqa: BLE001 - transformers and tokenizers raise many kinds
            raise TokenizerError(f"{d / 'tokenizer.json'} is not a readable tokenizer: {e}") from None
        if not isinstance(hf, TokenizersBackend):
            raise TokenizerError(f"{d}: transformers built a {type(hf).__name__}, not a fast tokenizer")
        self.hf = hf
        # The Rust tokenizer, for the detokenizer's DecodeStream (vLLM's FastIncrementalDetokenizer).
        self.backend = hf._tokenizer
        self.special_tokens_map: dict[str, str] = {
            k: str(v) for k, v in hf.special_tokens_map.items() if k in SPECIAL_TOKEN_NAMES and v
        }
        self.all_special_ids: list[int] = list(hf.all_special_ids)
        self._len = len(hf)
        self._named_templates = hf.chat_template if isinstance(hf.chat_template, dict) else None
        self.chat_template: str | None = _default_template(hf.chat_template)
        self.chat_template_from_flag = False  # --chat-template replaced the checkpoint's
        self.model_max_length = hf.model_max_length
        self._space_marker = _leading_space_marker(self.backend)
        self._pool_copy = copy.deepcopy(hf)
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenizer")

    @property
    def vocab_size(self) -> int:
        """Every id the tokenizer knows, added tokens included (``len(tokenizer)``)."""
        return self._len

    @functools.cached_property
    def max_chars_per_token(self) -> int:
        """The longest token's text in the vocabulary (vLLM's bound on a prompt's characters)."""
        return max(len(t) for t in self.get_vocab())

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
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    async def encode_async(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """``encode`` in the tokenizer thread: a long text never stalls other streams."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self._pool_copy.encode(text, add_special_tokens=add_special_tokens))

    async def in_pool(self, fn):
        """``fn(tokenizer)`` in the tokenizer thread, on its copy of the transformers
        tokenizer (whose ``encode``/``decode`` take the same arguments as these)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, fn, self._pool_copy)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)

    async def decode_async(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        """``decode`` in the tokenizer thread (vLLM's ``/detokenize``)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: self._pool_copy.decode(token_ids, skip_special_tokens=skip_special_tokens))

    def token_text(self, token_id: int) -> str:
        """One token as vLLM shows it in logprobs (``convert_ids_list_to_tokens``): the
        token decoded on its own, with the leading spaces a Metaspace decoder strips
        from its vocabulary piece put back."""
        text = self.hf.decode([token_id], skip_special_tokens=False) or ""
        if self._space_marker is None:
            return text
        piece = self.hf.convert_ids_to_tokens(token_id) or ""
        missing = (len(piece) - len(piece.lstrip(self._space_marker))) - (len(text) - len(text.lstrip(" ")))
        return " " * missing + text if missing > 0 else text

    def convert_ids_to_tokens(self, token_ids: list[int]) -> list[str]:
        return [t or "" for t in self.hf.convert_ids_to_tokens(token_ids)]

    def resolve_chat_template(self, requested: str | None, tools) -> str | None:
        """vLLM's ``resolve_chat_template``: the request's template (or a name among
        the checkpoint's named ones), else the server's; a checkpoint with named
        templates gives "tool_use" to a request with tools, where it has one."""
        if requested is not None:
            return self._named_templates.get(requested, requested) if self._named_templates else requested
        if tools is not None and self._named_templates and "tool_use" in self._named_templates and self.chat_template == _default_template(self._named_templates):
            return self._named_templates["tool_use"]
        return self.chat_template

    def apply_chat_template(self, conversation: list[dict], template: str, tools=None, tokenize: bool = False, **kwargs) -> str | list[int]:
        """transformers' ``apply_chat_template`` as vLLM's ``safe_apply_chat_template``
        calls it: the text, or (``tokenize``) its ids without special tokens."""
        return _apply_chat_template(self.hf, conversation, template, tools, tokenize, kwargs)

    async def apply_chat_template_async(self, conversation: list[dict], template: str, tools=None, tokenize: bool = False,
                                        **kwargs) -> str | list[int]:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, _apply_chat_template, self._pool_copy, conversation, template, tools, tokenize, kwargs)


def _apply_chat_template(hf, conversation: list[dict], template: str, tools, tokenize: bool, kwargs: dict) -> str | list[int]:
    return hf.apply_chat_template(conversation=conversation, tools=tools, chat_template=template, tokenize=tokenize, return_dict=False,
                                  **kwargs)


def _leading_space_marker(backend) -> str | None:
    """vLLM's ``get_leading_space_marker``: a Metaspace pre-tokenizer's replacement
    character (its decoder strips one leading space per text), else None."""
    pre = json.loads(backend.to_str()).get("pre_tokenizer") or {}
    for p in [pre, *(pre.get("pretokenizers") or [] if pre.get("type") == "Sequence" else [])]:
        if p.get("type") == "Metaspace":
            return p.get("replacement", "\u2581")
    return None


def _model_type(d: Path) -> str | None:
    try:
        config = json.loads((d / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return config.get("model_type") if isinstance(config, dict) else None


def _default_template(template) -> str | None:
    """A checkpoint's template: the string, or among named ones "default" (transformers' choice)."""
    if isinstance(template, dict):
        template = template.get("default")
    return template if isinstance(template, str) else None
