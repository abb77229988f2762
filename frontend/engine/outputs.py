"""What the engine client hands back: a request's TokenOutputs to its sink, or the
`EngineError` that ends it. How a response frame is read is in one place, `token_outputs`."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Protocol

from protocol.client_messages import ClientResponse, TokenOutput


class EngineError(RuntimeError):
    """The scheduler refused a request (``RequestError``, with the field it names as
    ``param``) or could not be reached."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class EngineUnreachable(EngineError):
    """No connection to the scheduler's client port in time."""


class OutputSink(Protocol):
    """Where one engine request's outputs go, called from the reader task: an output
    (its last one has ``finished``), or the error that ends the request. Neither may
    block; after ``on_error`` or the finished output nothing more comes."""

    def on_output(self, out: TokenOutput) -> None: ...

    def on_error(self, error: EngineError) -> None: ...


class QueueSink:
    """A sink over a queue, for a caller that awaits its outputs (`EngineClient.generate`)."""

    __slots__ = ("queue",)

    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_output(self, out: TokenOutput) -> None:
        self.queue.put_nowait(out)

    def on_error(self, error: EngineError) -> None:
        self.queue.put_nowait(error)


def token_outputs(msg: ClientResponse) -> Iterable[TokenOutput]:
    """The TokenOutputs one response frame carries: the batch of a step
    (``EngineCoreOutputs.outputs``), or a lone TokenOutput."""
    outputs = getattr(msg, "outputs", None)
    return (msg,) if outputs is None else outputs
