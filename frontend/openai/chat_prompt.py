"""A chat request as the engine runs it (vLLM's ``preprocess_chat`` and the chat
request's validators): the messages rendered with the checkpoint's chat template,
tokenized without special tokens (the template wrote them), checked, truncated, and
turned into the engine's parameters. Shared by the endpoint, its render and /tokenize."""

from __future__ import annotations

from dataclasses import replace

from frontend.openai.prompt_logprobs import (
    check_logprob_fields,
    num_prompt_logprobs,
    whole_vocabulary,
)
from frontend.openai.serving import ServingContext
from frontend.sampling.logits_fields import with_logits_fields
from frontend.sampling.params import (
    EngineParams,
    check_output_tokens,
    check_prompt_length,
    engine_params,
    output_budget,
    with_kv_transfer_params,
)
from frontend.schema.errors import bad_request
from frontend.schema.request_fields import check_routed_experts_start, check_unhonoured
from frontend.schema.requests import ChatCompletionRequest
from frontend.text.chat_messages import conversation
from frontend.text.chat_template import (
    NO_TEMPLATE,
    UNTRUSTED,
    ChatTemplateError,
    merge_kwargs,
    safe_apply_chat_template,
)
from frontend.text.chat_template import chat_template_kwargs as chat_template_kwargs_for
from frontend.text.content_format import detect_content_format
from frontend.text.truncation import check_truncation, tokens_kept, truncate_ids
from frontend.tools.choice import check_tool_parsing, check_tool_usage, template_tools
from frontend.tools.constraint import adjust_request


def check_request_templates(ctx: ServingContext, chat_template: str | None, chat_template_kwargs: dict | None) -> None:
    """vLLM's ``validate_chat_template``: a template from the request only with --trust-request-chat-template."""
    if not ctx.config.trust_request_chat_template and (chat_template is not None or (chat_template_kwargs or {}).get("chat_template") is not None):
        raise bad_request(UNTRUSTED)


async def chat_prompt(ctx: ServingContext, messages: list[dict], add_generation_prompt: bool, add_special_tokens: bool,
                      tools=None, documents=None, chat_template_kwargs=None, continue_final_message: bool = False,
                      chat_template: str | None = None, reasoning_effort: str | None = None) -> tuple[list[int], list[dict]]:
    """The prompt's token ids and the conversation rendered (vLLM's ``preprocess_chat``),
    in the tokenizer thread."""
    check_request_templates(ctx, chat_template, chat_template_kwargs)
    tok = ctx.tokenizer
    kwargs = chat_template_kwargs_for(ctx.config.default_chat_template_kwargs or {}, tools, chat_template_kwargs, add_generation_prompt,
                                      continue_final_message, documents, reasoning_effort)
    # NOTE: vLLM's order: the request's template, --chat-template, chat_template_kwargs' one, the checkpoint's.
    template = chat_template or (tok.chat_template if tok.chat_template_from_flag else None)
    kwargs = merge_kwargs(kwargs, {"chat_template": template})
    content_format = ctx.config.chat_template_content_format
    if content_format == "auto":  # NOTE: as vLLM, read from the template chat_template_kwargs' one would not replace
        resolved = tok.resolve_chat_template(template, kwargs.get("tools"))
        content_format = "string" if resolved is None else detect_content_format(resolved)
    chat = conversation(messages, content_format)
    try:
        out = await safe_apply_chat_template(tok, chat, **kwargs)
    except ChatTemplateError as e:
        raise bad_request(str(e), "messages" if str(e) == NO_TEMPLATE else None) from None
    except TypeError as e:  # a kwarg named like one of safe_apply_chat_template's own, as vLLM's 400
        raise bad_request(str(e)) from None
    if isinstance(out, str):
        out = await tok.encode_async(out, add_special_tokens=add_special_tokens)
    return out, chat


def check_generation_prompt(req) -> None:
    """vLLM's validator of a chat (or /tokenize) request's generation prompt."""
    # NOTE: as vLLM, only when both were sent; a default add_generation_prompt meets
    # transformers' own refusal when the template is applied.
    if req.continue_final_message and req.add_generation_prompt_sent is True:
        raise bad_request("Cannot set both `continue_final_message` and `add_generation_prompt` to True.")


def check_chat_fields(req: ChatCompletionRequest) -> None:
    """vLLM's request validators for what kvpool renders: the generation prompt and
    the multimodal kwargs it refuses without --trust-request-mm-kwargs (refused by
    kvpool's serve)."""
    check_generation_prompt(req)
    for name in ("mm_processor_kwargs", "media_io_kwargs"):
        if getattr(req, name):
            raise bad_request(f"Per-request {name} are disabled by default because they can change multimodal "
                              f"{'preprocessing' if name == 'mm_processor_kwargs' else 'media loading'} resource usage. "
                              f"Start the server with --trust-request-mm-kwargs only when clients are trusted. (parameter={name})", name)


async def chat_engine_input(ctx: ServingContext, req: ChatCompletionRequest,
                            rendered=None) -> tuple[list[int], int, int | None, EngineParams, list[dict]]:
    """A checked chat request as the engine runs it: (prompt token ids, max_tokens,
    logprobs asked for or None, engine params, the rendered conversation). Shared by
    the endpoint and its render. ``rendered()``, if given, is called between the
    prompt's checks and the sampling fields' (where vLLM's request gets its id)."""
    check_tool_usage(req)
    check_logprob_fields(req, "top_logprobs")
    ctx.check_model(req.model)
    check_unhonoured(req, "chat")
    if not req.messages:
        raise bad_request("messages must not be empty", "messages")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if req.max_completion_tokens is not None:
        check_output_tokens(req.max_completion_tokens, ctx.config.max_model_len, "max_completion_tokens")
    else:
        check_output_tokens(req.max_tokens, ctx.config.max_model_len)
    check_truncation(req.truncate_prompt_tokens, ctx.config.max_model_len)
    check_chat_fields(req)
    check_tool_parsing(req, ctx.tool_parser)
    shown = None if req.tool_choice == "none" and ctx.config.exclude_tools_when_tool_choice_none else template_tools(req.tools)
    ids, chat = await chat_prompt(ctx, req.messages, req.add_generation_prompt, req.add_special_tokens, shown, req.documents,
                                  req.chat_template_kwargs, req.continue_final_message, req.chat_template, req.reasoning_effort)
    adjust_request(req, ctx.tool_parser, ctx.config.enforce_strict_tool_calling, ctx.config.tool_strict_level)
    requested = req.max_completion_tokens or req.max_tokens
    # NOTE: the rendered prompt's ids, sliced: vLLM's tokenizer-level truncation gives the
    # same unless add_special_tokens puts specials around a chat prompt. Truncated to
    # nothing, the prompt goes on for the engine to refuse (vLLM's words, in the stream).
    keep = tokens_kept(req.truncate_prompt_tokens, ctx.config.max_model_len,
                       req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens)
    ids = truncate_ids(ids, keep, req.truncation_side)
    check_prompt_length(len(ids), ctx.config.max_model_len, from_text=True)
    check_routed_experts_start(req, len(ids))
    if rendered is not None:
        rendered()
    max_tokens = output_budget(requested, len(ids), ctx.config.max_model_len, ctx.default_sampling, ctx.max_tokens_cap)
    num_logprobs = (req.top_logprobs or 0) if req.logprobs else None
    if num_logprobs == -1:  # vLLM's -1: the whole vocabulary (over any --max-logprobs this server allows)
        num_logprobs = whole_vocabulary(ctx)
    params = engine_params(req, max_tokens, num_logprobs, ctx.default_sampling, ctx.config.max_n_sequences, ctx.config.max_logprobs)
    asked = req.prompt_logprobs
    if asked is None and getattr(req, "echo", False):  # NOTE: vLLM's chat echo asks for top_logprobs' worth
        asked = req.top_logprobs
    plp = num_prompt_logprobs(req, ctx, asked)
    if plp is not None:
        params = replace(params, generate={**params.generate, "prompt_logprobs": plp})
    params = with_kv_transfer_params(params, req.kv_transfer_params, ctx.config.kv_transfer_config is not None)
    return ids, max_tokens, num_logprobs, with_logits_fields(params, req, ctx.tokenizer, ctx.vocab_size), chat
