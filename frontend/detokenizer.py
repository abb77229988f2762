"""Incremental detokenization and stop strings, as vLLM's v1 detokenizer
(``vllm/v1/engine/detokenizer.py``) does them.

Tokens go through the ``tokenizers`` library's ``DecodeStream``, which returns text
only once a character is complete, so no chunk ever holds half a UTF-8 character. At
the end the text is made equal to decoding every id at once (a sequence that ends in
an incomplete character decodes to U+FFFD there, as the one-shot decode says).

Stop strings are matched on the text after each token; the text is cut before the
stop string (after it with ``include_stop_str_in_output``), and while streaming the
last ``len(longest stop) - 1`` characters are held back so that no client ever sees
the start of a stop string that is then taken away.
"""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from frontend.tokenizer import Tokenizer


def check_stop_strings(output_text: str, new_char_count: int, stop: list[str], include_in_output: bool) -> tuple[str, int] | None:
    """vLLM's ``check_stop_strings``: (the stop string, where to cut, -1 for nowhere),
    looking only at the text the last ``new_char_count`` characters could complete."""
    if not new_char_count or not stop:
        return None
    for stop_str in stop:
        stop_string_len = len(stop_str)
        stop_index = output_text.find(stop_str, 1 - new_char_count - stop_string_len)
        if stop_index == -1:
            continue
        if include_in_output:
            stop_index += stop_string_len
            if stop_index >= len(output_text):
                return stop_str, -1
        return stop_str, stop_index
    return None


class IncrementalDetokenizer:
    """One request's output text, grown a token at a time."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ):
        self._tokenizer = tokenizer
        self._backend = tokenizer.backend
        self._skip_special_tokens = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = [s for s in (stop or []) if s]
        self.include_stop_str_in_output = include_stop_str_in_output
        # NOTE: as vLLM, stop strings are not looked for until more than min_tokens came.
        self.min_tokens = min_tokens
        self.stop_buffer_length = 0 if include_stop_str_in_output or not self.stop else max(len(s) for s in self.stop) - 1
        self.token_ids: list[int] = []
        self.output_text = ""
        self.stop_reason: str | None = None
        self._sent = 0

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add the tokens; the stop string they completed, or None. After a stop the
        text is final and later tokens are not added."""
        if self.stop_reason is not None:
            return self.stop_reason
        step, backend = self._stream.step, self._backend
        for token_id in new_token_ids:
            self.token_ids.append(token_id)
            piece = step(backend, token_id)
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

    def finish(self) -> None:
        """The request ended: the text becomes the one-shot decode of every id (unless a
        stop string cut it)."""
        if self.stop_reason is None:
            full = self._tokenizer.decode(self.token_ids, skip_special_tokens=self._skip_special_tokens)
            if full.startswith(self.output_text):
                self.output_text = full

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
