"""The HTTP request bodies, as vLLM's ``CompletionRequest`` / ``ChatCompletionRequest``
(the OpenAI fields plus vLLM's sampling extras), decoded and type-checked by msgspec.

Unknown fields are ignored, as OpenAI clients send fields a server may not know; the
fields of vLLM's request classes that kvpool does not honour are declared in
``frontend.schema.request_fields`` (refused by name, or of no effect in vLLM either). A
body of the wrong shape is refused with msgspec's message, which names the field
(``Expected `int`, got `str` - at `$.max_tokens```). Ranges are checked in
``frontend.sampling.params``.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from frontend.schema.request_fields import UnhonouredFields
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


class _SamplingFields(UnhonouredFields, kw_only=True):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None  # None: the server's default (frontend.sampling.params)
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    stream: bool | None = False  # NOTE: None as vLLM's: not streamed
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None
    # vLLM's: an int64, lower first under --scheduling-policy priority; ignored by fcfs.
    priority: Priority = 0
    return_tokens_as_token_ids: bool | None = None
    # Each prompt token's logprob and the top-k (frontend.openai.prompt_logprobs); -1: every token.
    prompt_logprobs: int | None = None
    request_id: str | None = None
    # Structured outputs (frontend.sampling.structured_outputs): the seam forced tool calls
    # build on too; response_format ({"type": ...}) overrides it as in vLLM.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's logits processors (frontend.sampling.logits_fields): token id (a string key) -> bias,
    # the only tokens that may be sampled, words never to generate.
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] = []
    # Keep the prompt's last k tokens (-1: max_model_len's worth); truncation_side
    # "right" keeps the first k instead (frontend.text.truncation).
    truncate_prompt_tokens: Annotated[int, Meta(ge=-1, le=2**63 - 1)] | None = None
    truncation_side: Literal["left", "right"] | None = None
    # The prompt's token ids (once) and each choice's in the answer, as vLLM's.
    return_token_ids: bool | None = None
    response_format: dict[str, Any] | None = None
    # P/D disaggregation: checked and sent to the engine with --kv-transfer-config, else
    # ignored, as vLLM (frontend.sampling.params.with_kv_transfer_params).
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, a list of strings, a token-id list or a list of them (msgspec takes one
    # list type in a union: the shape is checked in frontend.openai.serving_completion).
    prompt: str | list[Any]
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = None
    add_special_tokens: bool = True
    suffix: str | None = None


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[dict[str, Any]]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = 0
    # NOTE: whether the client sent it matters (vLLM's check of continue_final_message
    # reads the raw body): ``add_generation_prompt`` is the value, True when not sent.
    add_generation_prompt_sent: bool | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="add_generation_prompt")
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    # vLLM's default: "auto" with tools, else "none" (frontend.tools.choice resolves UNSET).
    tool_choice: str | dict[str, Any] | None | msgspec.UnsetType = msgspec.UNSET
    parallel_tool_calls: bool | None = True
    documents: list[dict[str, Any]] | None = None
    echo: bool = False
    chat_template: str | None = None
    # A chat template variable (and enable_thinking's default), as vLLM's build_chat_params.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # Refused by name, as vLLM refuses them without --trust-request-mm-kwargs (frontend.openai.chat_prompt).
    mm_processor_kwargs: dict[str, Any] | None = None
    media_io_kwargs: dict[str, Any] | None = None

    @property
    def add_generation_prompt(self) -> bool:
        return True if self.add_generation_prompt_sent is msgspec.UNSET else self.add_generation_prompt_sent


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt_sent: bool | msgspec.UnsetType = msgspec.field(default=msgspec.UNSET, name="add_generation_prompt")
    return_token_strs: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    continue_final_message: bool = False
    chat_template: str | None = None
    tools: list[dict[str, Any]] | None = None

    @property
    def add_generation_prompt(self) -> bool:
        return True if self.add_generation_prompt_sent is msgspec.UNSET else self.add_generation_prompt_sent


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
