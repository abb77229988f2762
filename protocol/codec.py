"""Encoding and decoding frames, with one error type for every bad frame.

Build a `Codec` once per socket (msgspec encoders and decoders are reusable and
much faster reused). A frame that is malformed, truncated, oversized or of the
wrong type raises `ProtocolError`; it never raises anything else, so a process
loop can answer it and carry on.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import msgspec

T = TypeVar("T")

DEFAULT_MAX_FRAME_BYTES = 16 * 1024 * 1024


class ProtocolError(ValueError):
    """A frame that is not a valid message of the expected union."""


class Codec(Generic[T]):
    """Encoder/decoder pair for one message union, with a frame size limit."""

    def __init__(self, decode_type: Any, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES):
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(decode_type)
        self.max_frame_bytes = max_frame_bytes

    def encode(self, msg: Any) -> bytes:
        return self._encoder.encode(msg)

    def decode(self, frame: bytes | bytearray | memoryview) -> T:
        size = len(frame)
        if size > self.max_frame_bytes:
            raise ProtocolError(f"frame of {size} bytes is over the {self.max_frame_bytes}-byte limit")
        if size == 0:
            raise ProtocolError("empty frame")
        try:
            return self._decoder.decode(frame)
        except msgspec.ValidationError as e:
            raise ProtocolError(f"invalid message: {e}") from None
        except msgspec.DecodeError as e:
            raise ProtocolError(f"malformed frame: {e}") from None
        except (RecursionError, MemoryError, OverflowError) as e:
            raise ProtocolError(f"undecodable frame: {type(e).__name__}") from None
