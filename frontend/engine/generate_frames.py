"""A Generate's frame, read back with the scheduler's own decoder before it goes: a field
the wire cannot carry is refused here, naming it (an `EngineError` with that ``param``),
and never leaves."""

from __future__ import annotations

import re

from frontend.engine.outputs import EngineError
from protocol.client_messages import ClientRequest, ClientResponse, Generate
from protocol.codec import Codec, ProtocolError


class GenerateFrames:
    __slots__ = ("codec", "check")

    def __init__(self, codec: Codec[ClientResponse]):
        self.codec = codec  # the client's own (encodes every request message)
        self.check: Codec[ClientRequest] = Codec(ClientRequest)  # the scheduler's decoder

    def frame(self, msg: Generate) -> bytes:
        try:
            frame = self.codec.encode(msg)
            self.check.decode(frame)
        except (ProtocolError, OverflowError, TypeError) as e:
            raise EngineError(f"the request cannot be sent to the engine: {e}", field_of(str(e))) from None
        return frame


def field_of(message: str) -> str | None:
    """The top-level field a msgspec error names (``... - at `$.stop_token_ids[0]```)."""
    at = message.rfind("`$.")
    return re.split(r"[\[.`]", message[at + 3:], maxsplit=1)[0] or None if at >= 0 else None
