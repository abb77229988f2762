"""For tests of the frontend's engine client over real sockets: a sink that records what
reaches it, and a bounded wait."""

from __future__ import annotations

import asyncio

WAIT_S = 10


class RecordingSink:
    """An OutputSink that keeps every output and error it is given."""

    def __init__(self):
        self.outputs: list = []
        self.errors: list = []

    def on_output(self, out) -> None:
        self.outputs.append(out)

    def on_error(self, error) -> None:
        self.errors.append(error)

    @property
    def token_ids(self) -> list[int]:
        return [t for o in self.outputs for t in o.new_token_ids]


async def until(predicate, bound_s: float = WAIT_S) -> None:
    """Return once ``predicate()`` holds; AssertionError after ``bound_s``."""
    for _ in range(int(bound_s * 100)):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError("not within the bound")
