"""Messages between clients (the load generator) and the scheduler's client port.

Clients hold a ZMQ DEALER socket; the scheduler a ROUTER. One frame per message.
Messages are maps tagged by ``"type"`` so a hand-written client can speak them.

Responses come one frame per client per step: an `EngineCoreOutputs` holding a
`TokenOutput` for each of that client's requests that got a token (or ended), as
vLLM's engine core sends one EngineCoreOutputs per client per step. A refusal is a
`RequestError` of its own: it answers one frame, not a step.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec
from msgspec import Meta

from protocol.kv_transfer_params import KVTransferParams
from protocol.prompt_logprobs import PromptLogprobs
from protocol.structured_output import GrammarSpec

TokenId = Annotated[int, Meta(ge=0, le=2**31 - 1)]
MAX_REQUEST_ID_LENGTH = 256
RequestId = Annotated[str, Meta(min_length=1, max_length=MAX_REQUEST_ID_LENGTH)]
# vLLM's request priority: an int64, lower runs first (with --scheduling-policy priority).
Priority = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]


class Generate(msgspec.Struct, tag="generate", tag_field="type", omit_defaults=True, forbid_unknown_fields=True):
    """Start a request. Its tokens come back, as they are produced, as TokenOutputs in
    the client's EngineCoreOutputs of each step."""

    request_id: RequestId
    prompt_token_ids: list[TokenId]
    max_tokens: int = 16
    ignore_eos: bool = False
    # Requests with different salts never share a KV block (tenant isolation).
    cache_salt: str | None = None
    # vLLM's SamplingParams subset (ranges: protocol.sampling_params.check_sampling).
    # NOTE: temperature defaults to 0 (greedy), not vLLM's 1.0: this protocol's clients
    # are benchmarks and tests, which want the same tokens every run.
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # Finish ("stop") on any of these, as on EOS; the stop token is included.
    # NOTE: these ids, allowed_token_ids and logit_bias's are any int64 on the wire:
    # the scheduler refuses one outside the vocabulary in vLLM's words (check_sampling).
    stop_token_ids: list[int] = []
    # Return each sampled token's logprob and the top-k (k <= 20).
    logprobs: int | None = None
    # Lower first under --scheduling-policy priority (then by arrival); ignored by fcfs.
    priority: Priority = 0
    # vLLM's logits processors: only these tokens may be sampled (None: any); a bias
    # in [-100, 100] added to a token's logit; token-id sequences whose last token is
    # never sampled right after the rest (the frontend tokenizes vLLM's bad_words).
    allowed_token_ids: list[int] | None = None
    logit_bias: dict[int, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None
    bad_words_token_ids: list[list[TokenId]] = []
    # Structured outputs (checked and converted by the frontend, as vLLM's API server):
    # every sampled token must keep the output inside this grammar.
    structured_outputs: GrammarSpec | None = None
    # Every prompt token's logprob and the top-k (k <= 20), with the first output token.
    # As vLLM, such a request never reads the prefix cache (skip_reading_prefix_cache).
    prompt_logprobs: int | None = None
    # A request resubmitted by a client that lost its scheduler (a kvpool extension): the
    # output tokens it already received. It resumes as a preempted request does: these
    # are recomputed, not sampled again, and max_tokens and min_tokens count them.
    resumed_token_ids: list[TokenId] = []
    # P/D disaggregation (protocol/kv_transfer_params.py): a prefill engine's request
    # (do_remote_decode) keeps its blocks for a decode engine; a decode engine's
    # (do_remote_prefill) reads its prompt's blocks from the prefill engine's worker.
    # Ignored by an engine without --kv-transfer-config, as vLLM's.
    kv_transfer_params: KVTransferParams | None = None


class Abort(msgspec.Struct, tag="abort", tag_field="type", forbid_unknown_fields=True):
    """Stop a request early; its blocks are freed and it finishes with reason "abort".
    ``stopped``: the client ended it on a stop string, so in the metrics it is a finished
    request (vLLM's output processor records a stop-string finish), not an aborted one."""

    request_id: RequestId
    stopped: bool = False


ClientRequest = Generate | Abort


class TokenLogprobs(msgspec.Struct, omit_defaults=True):
    """The logprob of a sampled token (from the model's raw logits, as vLLM's default
    ``raw_logprobs``) and the top-k tokens with theirs, most likely first."""

    logprob: float
    top_token_ids: list[int] = []
    top_logprobs: list[float] = []


class TokenOutput(msgspec.Struct, omit_defaults=True, gc=False):
    """New tokens of one request (vLLM's EngineCoreOutput); a request's last one has
    finished=True. Not a message of its own: it travels in `EngineCoreOutputs`.

    gc=False: it holds no reference cycle (lists of numbers and strings only)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    # "length" (max_tokens), "stop" (EOS), "abort" (client abort or shutdown), "error".
    finish_reason: str | None = None
    # Prompt tokens served from the prefix cache at admission.
    num_cached_tokens: int = 0
    # One per new token when the request asked for logprobs.
    logprobs: list[TokenLogprobs] | None = None
    # With the first output token, when the request asked for prompt_logprobs.
    prompt_logprobs: PromptLogprobs | None = None
    # With the last output of a prefill engine's request (do_remote_decode): where a
    # decode engine reads its blocks (protocol/kv_transfer_params.py's answer keys).
    kv_transfer_params: dict[str, Any] | None = None


class EngineCoreOutputs(msgspec.Struct, tag="outputs", tag_field="type", omit_defaults=True, gc=False):
    """Every TokenOutput of one client's requests in one step, in batch order.

    NOTE: one frame per client per step, not one per request: a frame's encoding and
    send cost mostly the same whatever it holds, so a frame per request would grow a
    decode step's sending with its batch. An empty one (no outputs) is a liveness
    probe; clients ignore it."""

    outputs: list[TokenOutput] = []


class RequestError(msgspec.Struct, tag="error", tag_field="type", omit_defaults=True):
    """A request (or a frame) was refused; nothing else changed. request_id is None
    when the frame could not be read far enough to know it."""

    message: str
    request_id: str | None = None
    # The request field it names (the OpenAI error's ``param``), when there is one.
    param: str | None = None


ClientResponse = EngineCoreOutputs | RequestError


class _RequestIdOnly(msgspec.Struct):
    request_id: str | None = None


_peek_decoder = msgspec.msgpack.Decoder(_RequestIdOnly)


def peek_request_id(frame: bytes | bytearray | memoryview) -> str | None:
    """The ``request_id`` of a frame that is not a valid request (a field out of range,
    a wrong type, over the size limit), read leniently so that its refusal names the
    request and reaches whoever waits on it; None when the frame is not a map with a
    string ``request_id``."""
    try:
        return _peek_decoder.decode(frame).request_id
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError, MemoryError, OverflowError):
        return None


# --- pinned prefixes (a kvpool extension) -----------------------------------------------
# The API server's POST /v1/cache/pin and /v1/cache/unpin, as it forwards them to the
# scheduler's HTTP port (JSON): the prompt already tokenized.


class PinPrefix(msgspec.Struct, omit_defaults=True, forbid_unknown_fields=True):
    """Pin (or unpin) the full blocks of a prompt's tokens; ``ttl_s``: release after
    that many seconds (pin only; None: until unpinned)."""

    prompt_token_ids: list[TokenId]
    cache_salt: str | None = None
    ttl_s: Annotated[float, Meta(gt=0)] | None = None


class PinResult(msgspec.Struct):
    """Pin: the prompt's full blocks now pinned (0 with ``missing_blocks`` > 0: not all
    were cached, nothing was pinned). Unpin: the blocks released."""

    pinned_blocks: int
    pinned_tokens: int
    missing_blocks: int = 0
    block_size: int = 0
