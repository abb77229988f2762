"""Every field of vLLM 0.32's ``CompletionRequest`` and ``ChatCompletionRequest``, and
what kvpool does with it: ``honoured`` (as vLLM does), ``no effect, as vLLM`` (vLLM
accepts it and, in the configuration kvpool serves -- no watermark config, no reasoning
parser, no KV connector but kvpool's own, no custom logits processors, text only -- it
changes nothing there either) or ``refused`` (a 400 naming the field, unless the value
is one under which vLLM behaves as kvpool does).

A field of neither request class is ignored, as vLLM ignores unknown fields; a field of
one of them is never accepted and then ignored. ``tests/frontend/schema/test_request_fields.py``
holds this table to vLLM 0.32's field lists (``tests/frontend/data/``), and
``docs/vllm-request-fields.md`` is generated from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from frontend.schema.errors import bad_request

HONOURED = "honoured"
NO_EFFECT = "no effect, as vLLM"
REFUSED = "refused"

BOTH, COMPLETION, CHAT = ("completion", "chat"), ("completion",), ("chat",)


@dataclass(frozen=True, slots=True)
class RequestField:
    status: str
    note: str  # how it is honoured, why it has no effect in vLLM either, or the refusal's reason
    endpoints: tuple[str, ...] = BOTH


_H, _N, _R = HONOURED, NO_EFFECT, REFUSED
_MM = "kvpool serves text-only models"

FIELDS: dict[str, RequestField] = {
    # The OpenAI fields.
    "model": RequestField(_H, "checked against --served-model-name (404 otherwise)"),
    "prompt": RequestField(_H, "a string, a list of strings, a token-id list or a list of them", COMPLETION),
    "messages": RequestField(_H, "rendered with the checkpoint's chat template", CHAT),
    "echo": RequestField(_H, "the prompt (completions) or the last message (chat) before the output"),
    "frequency_penalty": RequestField(_H, "the worker's batched penalties"),
    "presence_penalty": RequestField(_H, "the worker's batched penalties"),
    "logit_bias": RequestField(_H, "added to the logits in the worker, clamped to [-100, 100]"),
    "logprobs": RequestField(_H, "the sampled token's and the top-k logprobs from the raw logits"),
    "top_logprobs": RequestField(_H, "chat: the top-k with logprobs=true", CHAT),
    "max_tokens": RequestField(_H, "bounded by the context left, as vLLM's get_max_tokens"),
    "max_completion_tokens": RequestField(_H, "chat: wins over max_tokens", CHAT),
    "n": RequestField(_H, "n engine requests, choices in order (n > 1 needs sampling, as vLLM)"),
    "seed": RequestField(_H, "a generator of its own per request"),
    "stop": RequestField(_H, "stop strings matched by the frontend on the detokenized text"),
    "stream": RequestField(_H, "server-sent events"),
    "stream_options": RequestField(_H, "include_usage, continuous_usage_stats"),
    "suffix": RequestField(_R, "suffix is not currently supported (vLLM's answer too)", COMPLETION),
    "temperature": RequestField(_H, "the worker's sampler"),
    "top_p": RequestField(_H, "the worker's sampler"),
    "user": RequestField(_N, "vLLM ignores it (its protocol says so)"),
    "response_format": RequestField(_H, "text, json_object, json_schema through xgrammar (type structural_tag refused by "
                                        "name)"),
    "tools": RequestField(_H, "passed to the chat template; calls parsed with --tool-call-parser", CHAT),
    "tool_choice": RequestField(_H, "none, auto (--enable-auto-tool-choice), required and named (forced through "
                                    "structured outputs)", CHAT),
    "parallel_tool_calls": RequestField(_H, "as vLLM's tool parsers read it", CHAT),
    "reasoning_effort": RequestField(_H, "passed to the chat template (and enable_thinking), as vLLM", CHAT),
    "include_reasoning": RequestField(_N, "acts only with a reasoning parser, which kvpool does not have", CHAT),
    "thinking_token_budget": RequestField(_R, "thinking_token_budget is set but reasoning_config is not configured "
                                              "(vLLM's 400 without --reasoning-parser)"),
    # vLLM's sampling extras.
    "use_beam_search": RequestField(_R, "beam search is not supported by kvpool (accepted: false)"),
    "top_k": RequestField(_H, "the worker's sampler"),
    "min_p": RequestField(_H, "the worker's sampler"),
    "repetition_penalty": RequestField(_H, "the worker's batched penalties, over prompt and output"),
    "watermarking": RequestField(_N, "vLLM runs without it when the engine has no watermark configuration"),
    "length_penalty": RequestField(_N, "vLLM reads it for beam search only"),
    "stop_token_ids": RequestField(_H, "the scheduler's stop check"),
    "include_stop_str_in_output": RequestField(_H, "the frontend's stop-string match"),
    "ignore_eos": RequestField(_H, "the scheduler's stop check"),
    "min_tokens": RequestField(_H, "EOS and stop ids masked in the worker until reached"),
    "skip_special_tokens": RequestField(_H, "the frontend's detokenizer"),
    "spaces_between_special_tokens": RequestField(_H, "the frontend's detokenizer"),
    "truncate_prompt_tokens": RequestField(_H, "the prompt's last k tokens kept (-1: the context less one) before the length "
                                               "check"),
    "truncation_side": RequestField(_H, "which end truncate_prompt_tokens keeps"),
    "allowed_token_ids": RequestField(_H, "every other token masked in the worker"),
    "prompt_logprobs": RequestField(_H, "computed by the worker during prefill; such a request skips reading the "
                                        "prefix cache, as vLLM's"),
    "logprob_token_ids": RequestField(_R, "logprob_token_ids is not supported by kvpool"),
    "bad_words": RequestField(_H, "tokenized with and without a leading space; the worker bans each word's last "
                                  "token after its prefix"),
    "prompt_embeds": RequestField(_R, "prompt_embeds are not supported by kvpool (vLLM needs "
                                      "--enable-prompt-embeds)", COMPLETION),
    "add_special_tokens": RequestField(_H, "the tokenizer's special tokens around the prompt"),
    "add_generation_prompt": RequestField(_H, "the chat template's variable", CHAT),
    "continue_final_message": RequestField(_H, "the chat template continues the last message", CHAT),
    "documents": RequestField(_H, "the chat template's variable", CHAT),
    "chat_template": RequestField(_H, "only with --trust-request-chat-template, as vLLM", CHAT),
    "chat_template_kwargs": RequestField(_H, "the chat template's variables, over --default-chat-template-kwargs", CHAT),
    "media_io_kwargs": RequestField(_R, "vLLM's 400 without --trust-request-mm-kwargs, which kvpool refuses (text only)",
                                    CHAT),
    "mm_processor_kwargs": RequestField(_R, "vLLM's 400 without --trust-request-mm-kwargs, which kvpool refuses (text only)",
                                        CHAT),
    "structured_outputs": RequestField(_H, "json, regex, choice, grammar, json_object, structural_tag through xgrammar, "
                                           "compiled on the worker"),
    "priority": RequestField(_H, "--scheduling-policy priority (the X-Vllm-Priority header wins)"),
    "request_id": RequestField(_H, "the response id; the engine's id adds a random suffix"),
    "session_id": RequestField(_N, "vLLM hands it to KV connectors; NixlConnector's contract, kvpool's, does not read it"),
    "return_tokens_as_token_ids": RequestField(_H, "logprob tokens as token_id:N"),
    "return_token_ids": RequestField(_H, "prompt_token_ids and each choice's token_ids in the answer"),
    "routed_experts_prompt_start": RequestField(_N, "checked (0..prompt length) as vLLM checks it; acts only for "
                                                    "MoE routed-expert capture"),
    "return_token_offsets": RequestField(_N, "vLLM honours it on the render endpoints only, not on generation"),
    "return_prompt_text": RequestField(_R, "return_prompt_text is not supported by kvpool", CHAT),
    "mm_payload": RequestField(_N, f"{_MM}; vLLM reads it for multimodal items of a render answer only"),
    "return_mm_kwargs": RequestField(_N, "vLLM's deprecated alias of mm_payload"),
    "cache_salt": RequestField(_H, "in the first block's hash: salted requests share no block"),
    "kv_transfer_params": RequestField(_H, "with --kv-transfer-config: P/D disaggregation, checked and passed to the "
                                           "engine, a prefill's answer carries them (docs/pd-disaggregation.md); "
                                           "ignored without it, as vLLM"),
    "ec_transfer_params": RequestField(_N, "vLLM passes them to an encoder-cache connector, which kvpool does not have"),
    "vllm_xargs": RequestField(_N, "vLLM passes them to custom logits processors, which kvpool does not load"),
    "repetition_detection": RequestField(_R, "repetition_detection is not supported by kvpool"),
    "stream_interval": RequestField(_R, "stream_interval above 1 is not supported by kvpool (accepted: 1)"),
}

# NOTE: the fields kvpool declares only to refuse them or to check them as vLLM does; the
# honoured ones live in frontend.schema.requests's request classes. UNSET: not sent.
_INT64_MAX = 2**63 - 1


class UnhonouredFields(msgspec.Struct, kw_only=True):
    use_beam_search: bool = False
    thinking_token_budget: int | None = None
    logprob_token_ids: list[int] | None = None
    prompt_embeds: Any = None
    repetition_detection: dict[str, Any] | None = None
    stream_interval: Annotated[int, Meta(ge=1)] | None = None
    return_prompt_text: bool | None = None
    # No effect, as vLLM: typed as vLLM types them, so a wrong type is still a 400.
    watermarking: bool | None = None
    length_penalty: float = 1.0
    include_reasoning: bool = True
    session_id: str | None = None
    routed_experts_prompt_start: Annotated[int, Meta(ge=0, le=_INT64_MAX)] = 0
    return_token_offsets: bool | None = False
    mm_payload: str = "tensors"
    return_mm_kwargs: bool | None = None
    ec_transfer_params: dict[str, Any] | None = None
    vllm_xargs: dict[str, Any] | None = None


def check_unhonoured(req: UnhonouredFields, endpoint: str) -> None:
    """A 400 naming the first field set to a value kvpool cannot honour, in vLLM's words
    where vLLM refuses it too. A field of the other endpoint only is ignored, as vLLM
    ignores a field it does not know."""
    if req.use_beam_search:
        raise bad_request("use_beam_search is not supported by kvpool: beam search is not implemented", "use_beam_search")
    if req.thinking_token_budget is not None and req.thinking_token_budget != -1:
        raise bad_request("thinking_token_budget is set but reasoning_config is not configured. Please set "
                          "--reasoning-parser and/or --reasoning-config to use thinking_token_budget.",
                          "thinking_token_budget")
    for name in ("logprob_token_ids", "prompt_embeds", "repetition_detection"):
        if getattr(req, name) is not None and endpoint in FIELDS[name].endpoints:
            raise bad_request(f"{name} is not supported by kvpool", name)
    if req.stream_interval is not None and req.stream_interval > 1:
        raise bad_request(f"stream_interval above 1 is not supported by kvpool, got {req.stream_interval}",
                          "stream_interval")
    if req.return_prompt_text and endpoint == "chat":
        raise bad_request("return_prompt_text is not supported by kvpool", "return_prompt_text")
    if req.mm_payload not in ("tensors", "none"):
        raise bad_request(f"mm_payload must be 'tensors' or 'none', got {req.mm_payload!r}", "mm_payload")


def check_routed_experts_start(req: UnhonouredFields, num_prompt_tokens: int) -> None:
    """vLLM's range check of a no-effect field, once a prompt's length is known."""
    if not 0 <= req.routed_experts_prompt_start <= num_prompt_tokens:
        raise bad_request(f"routed_experts_prompt_start must be between 0 and the prompt length ({num_prompt_tokens}), "
                          "inclusive.", "routed_experts_prompt_start")


def fields_doc() -> str:
    """``docs/vllm-request-fields.md``: the table above, one line a field."""
    lines = ["# vLLM 0.32's request fields in kvpool", "",
             "Generated from `frontend/schema/request_fields.py` (a test fails when they differ). Every field of vLLM "
             "0.32's `CompletionRequest` and `ChatCompletionRequest`: honoured as vLLM honours it, accepted with no "
             "effect because it has none in vLLM either in the configuration kvpool serves, or refused with a 400 "
             "naming it.", "", "| field | endpoints | kvpool | how, or why |", "| --- | --- | --- | --- |"]
    for name, f in FIELDS.items():
        lines.append(f"| `{name}` | {', '.join(f.endpoints)} | {f.status} | {f.note} |")
    return "\n".join(lines) + "\n"
