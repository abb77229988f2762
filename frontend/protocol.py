"""The HTTP request bodies, as vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(the OpenAI fields plus vLLM's sampling extras), decoded and type-checked by msgspec.

Unknown fields are ignored, as OpenAI clients send fields a server may not know. A
body of the wrong shape is refused with msgspec's message, which names the field
(``Expected `int`, got `str` - at `$.max_tokens```). Ranges are checked in
``frontend.sampling``.
"""

from __future__ import annotations

from typing import Any

import msgspec

from protocol.client_messages import Priority


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's ``StructuredOutputsParams`` (a request's ``structured_outputs``, and what
    ``response_format`` and a forced tool call become): exactly one of json, regex,
    choice, grammar, json_object and structural_tag constrains the output."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class _SamplingFields(msgspec.Struct, kw_only=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # None: the server's default (frontend.sampling)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's: an int64, lower first under --scheduling-policy priority; ignored by fcfs.
    priority: Priority = 0
    return_tokens_as_token_ids: bool | None = None
    # Each prompt token's logprob and the top-k (frontend.prompt_logprobs); -1: every token.
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # NOTE: not yet honoured (issue 23's structured-outputs work): the seam both it and
    # forced tool calls build on.
    structured_outputs: StructuredOutputsParams | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a token-id list or a list of them (msgspec takes one
    # list type in a union: the shape is checked in frontend.serving_completion).
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    documents: list[dict[str, Any]] | None = None


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
