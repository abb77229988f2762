"""``--enable-log-outputs`` (with ``--enable-log-requests``): each chat output logged
as vLLM's ``RequestLogger.log_outputs`` logs it, its wording. Text and finish reason
at INFO, token ids at DEBUG; a stream logs each delta that has text (unless
``--no-enable-log-deltas``) and, at its end, each choice's whole text. As vLLM, only
``/v1/chat/completions`` logs outputs (its completions endpoint logs none)."""

from __future__ import annotations

import logging
from collections.abc import Sequence

log = logging.getLogger("frontend")


class OutputLog:
    __slots__ = ("max_log_len", "deltas")

    def __init__(self, max_log_len: int | None = None, deltas: bool = True):
        self.max_log_len = max_log_len  # --max-log-len: text and token ids cut to this many
        self.deltas = deltas  # --enable-log-deltas

    def output(self, request_id: str, text: str, token_ids: Sequence[int] | None, finish_reason: str | None,
               streaming: bool = False, delta: bool = False) -> None:
        n = self.max_log_len
        if n is not None:
            text = text[:n]
        info = (" (streaming delta)" if delta else " (streaming complete)") if streaming else ""
        if log.isEnabledFor(logging.DEBUG):
            ids = list(token_ids)[:n] if n is not None and token_ids is not None else token_ids
            log.debug("Generated response %s%s details: output_token_ids: %s", request_id, info, ids)
        log.info("Generated response %s%s: output: %r, finish_reason: %s", request_id, info, text, finish_reason)

    def delta(self, request_id: str, text: str, token_ids: Sequence[int], finish_reason: str | None) -> None:
        """A streamed delta: logged when it has text and deltas are logged."""
        if text and self.deltas:
            self.output(request_id, text, token_ids, finish_reason, streaming=True, delta=True)

    def stream_end(self, request_id: str, texts: list[str]) -> None:
        """Each choice's whole streamed text, once the stream is done."""
        for text in texts:
            self.output(request_id, text, None, "streaming_complete", streaming=True)
