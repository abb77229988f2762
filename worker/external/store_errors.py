"""StoreError: an external store that cannot take or give an object now."""

from __future__ import annotations


class StoreError(Exception):
    """The store refused an operation: ``reason`` (full, unreachable, io) names why, for
    the metric; the message says what happened."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
