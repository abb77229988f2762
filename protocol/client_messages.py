"""Messages between clients (the load generator) and the scheduler's client port.

Clients hold a ZMQ DEALER socket; the scheduler a ROUTER. One frame per message.
Messages are maps tagged by ``"type"`` so a hand-written client can speak them.
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
RequestId = Annotated[str, Meta(min_length=1, max_length=256)]


class Generate(msgspec.Struct, tag="generate", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    """Start a request. Tokens come back as TokenOutput messages as they are produced."""

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    max_tokens: int = 16
    ignore_eos: bool = False
    # Requests with different salts never share a KV block (tenant isolation).
    cache_salt: str | None = None


class Abort(msgspec.Struct, tag="abort", tag_field="type", forbid_unknown_fields=True):
    """Stop a request early; its blocks are freed and it finishes with reason "abort"."""

    request_id: RequestId


ClientRequest = Generate | Abort


class TokenOutput(msgspec.Struct, tag="output", tag_field="type", omit_defaults=True):
    """New tokens of one request; the last message of a request has finished=True."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    # "length" (max_tokens), "stop" (EOS), "abort" (client abort or shutdown), "error".
    finish_reason: str | None = None
    # Prompt tokens served from the prefix cache at admission.
    num_cached_tokens: int = 0


class RequestError(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    """A request (or a frame) was refused; nothing else changed. request_id is None
    when the frame could not be read far enough to know it."""

    message: str
    request_id: str | None = None


ClientResponse = TokenOutput | RequestError
