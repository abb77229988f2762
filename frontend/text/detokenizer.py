"""Incremental detokenization and stop strings, as vLLM's v1 detokenizer
(``vllm/v1/engine/detokenizer.py``, its ``FastIncrementalDetokenizer``) does them.

Tokens go through the ``tokenizers`` library's ``DecodeStream``, seeded with the
prompt's ids as vLLM seeds it: a token's text depends on what precedes it (a
SentencePiece-style Metaspace decoder drops the leading space of the first token it
decodes), so the first output token is decoded as the prompt's continuation. The
stream returns text only once a character is complete: no chunk ever holds half a
UTF-8 character, and (as vLLM) a sequence that ends inside a character ends without it.

With ``skip_special_tokens=False`` and ``spaces_between_special_tokens=False``, an
added token that follows another added token is its bare content, with no space the
decoder would put between them (vLLM's rule). A request that ended on a stop token
(EOS, ``stop_token_ids``) does not detokenize that token unless
``include_stop_str_in_output``.

Stop strings are matched on the text after each token; the text is cut before the
stop string (after it with ``include_stop_str_in_output``), and while streaming the
last ``len(longest stop) - 1`` characters are held back so that no client ever sees
the start of a stop string that is then taken away.
"""

from __future__ import annotations

import sys

from tokenizers.decoders import DecodeStream

from frontend.text.tokenizer import Tokenizer


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str], include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: (the stop string, where to cut, -1 for nowhere),
    looking only at the text the last ``new_char_count`` characters could complete.
    NOTE: of several stop strings in that text, the one that ends first wins (ties:
    the list's order), so several tokens at once stop where one at a time would."""
    if not new_char_count or not stop:
        return None
    best, best_index, best_end = None, 0, sys.maxsize
    for stop_str in stop:
        stop_index = output_text.find(stop_str, 1 - new_char_count - len(stop_str))
        if stop_index != -1 and stop_index + len(stop_str) < best_end:
            best, best_index, best_end = stop_str, stop_index, stop_index + len(stop_str)
    if best is None:
        return None
    if include_in_output:
        return best, (-1 if best_end >= len(output_text) else best_end)
    return best, best_index


class IncrementalDetokenizer:
    """One request's output text, grown a token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
        prompt_token_ids: list[int] | None = None,
        spaces_between_special_tokens: bool = True,
    ):
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(ids=list(prompt_token_ids or ()), skip_special_tokens=skip_special_tokens)
        # vLLM's: added tokens in a row lose the decoder's spaces only when kept and asked to.
        self._added_tokens: dict[int, str] | None = None
        if not (skip_special_tokens or spaces_between_special_tokens):
            self._added_tokens = {i: t.content for i, t in self._backend.get_added_tokens_decoder().items()} or None
        self._last_added = False
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # NOTE: as vLLM, stop strings are not looked for until more than min_tokens came.
        self.min_tokens = min_tokens
        self.stop_buffer_length = 0 if include_stop_str_in_output or not self.stop else max(len(s) for s in self.stop) - 1
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._sent = 0

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Add the tokens; the stop string they completed, or None. After a stop the
        text is final and later tokens are not added. ``stop_terminated``: the last
        token is the stop token that ended the request (not detokenized, as vLLM,
        unless include_stop_str_in_output)."""
        if self.stop_reason is not None:
            return self.stop_reason
        skipped = stop_terminated and not self.include_stop_str_in_output and bool(new_token_ids)
        for i, token_id in enumerate(new_token_ids):
            self.token_ids.append(token_id)
            if skipped and i == len(new_token_ids) - 1:
                break
            piece = self._decode_next(token_id)
            if not piece:
                continue
            self.output_text += piece
            if len(self.token_ids) <= self.min_tokens:
                continue
            hit = check_stop_strings(self.output_text, len(piece), self.stop, self.include_stop_str_in_output)
            if hit is not None:
                self.stop_reason, cut = hit
                if cut != -1:
                    self.output_text = self.output_text[:cut]
                return self.stop_reason
        return None

    def _decode_next(self, token_id: int) -> str:
        try:
            piece = self._stream.step(self._backend, token_id)
        except Exception as e:  # noqa: BLE001 - the library raises a bare Exception
            if not str(e).startswith("Invalid prefix encountered"):
                raise
            # NOTE: vLLM's recovery when a tokenizer's output is not monotonic UTF-8:
            # a fresh stream, unseeded.
            self._stream = DecodeStream(skip_special_tokens=self._skip_special_tokens)
            piece = self._stream.step(self._backend, token_id)
        if self._added_tokens is not None:
            content = self._added_tokens.get(token_id)
            if content is not None and self._last_added:
                piece = content
            self._last_added = content is not None
        return piece or ""

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The whole text, or (``delta``) what was not returned yet; while unfinished
        the stop-string buffer is held back."""
        length = len(self.output_text) - (0 if finished else self.stop_buffer_length)
        if not delta:
            return self.output_text[:length] if length > 0 else ""
        if length <= self._sent:
            return ""
        text = self.output_text[self._sent:length]
        self._sent = length
        return text
