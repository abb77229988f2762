"""Chat templates as vLLM 0.32 renders them (``vllm/renderers/hf.py``,
``safe_apply_chat_template``): transformers' own ``apply_chat_template`` (its sandbox,
filters and ``{% generation %}`` tag), with the kwargs vLLM lets through.

vLLM's kwargs, lowest first: ``--default-chat-template-kwargs``, then the server's
``tools`` and ``tokenize=False``; over them the request's ``chat_template_kwargs``,
over which its own ``add_generation_prompt``, ``continue_final_message`` and
``documents`` win (a null or "auto" never overrides: vLLM's ``merge_kwargs``). Of
what is left, only the names ``apply_chat_template`` takes or the template reads
reach it (``resolve_chat_template_kwargs``); anything the template or transformers
refuses is a 400 with its reason. The rendered text is then tokenized with the
request's ``add_special_tokens`` (unless ``tokenize`` was asked for: then the ids
are transformers', without special tokens).
"""

from __future__ import annotations

import inspect
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.meta
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, or one that failed (its own raise_exception included)."""


NO_TEMPLATE = ("As of transformers v4.44, default chat template is no longer allowed, so you must provide "
               "a chat template if the tokenizer does not define one.")
UNTRUSTED = ("Chat template is passed with request, but --trust-request-chat-template is not set. "
             "Refused request with untrusted chat template.")
_UNSET = (None, "auto")
_UNEXPECTED = frozenset(("chat_template", "tokenize"))


def merge_kwargs(defaults: dict | None, overrides: dict | None) -> dict:
    """vLLM's ``merge_kwargs``: ``overrides`` over ``defaults``, but a None or "auto" override leaves the default."""
    return (defaults or {}) | {k: v for k, v in (overrides or {}).items() if not any(v is u or (isinstance(v, str) and v == u) for u in _UNSET)}


def chat_template_kwargs(server_defaults: dict, tools, requested: dict | None, add_generation_prompt: bool,
                         continue_final_message: bool, documents, reasoning_effort: str | None = None) -> dict:
    """Every kwarg of one request's ``apply_chat_template`` call, merged as vLLM merges them
    (a reasoning_effort also sets enable_thinking, unless chat_template_kwargs does)."""
    defaults = merge_kwargs(server_defaults, {"tools": tools, "tokenize": False})
    extra = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
             "documents": documents, "reasoning_effort": reasoning_effort}
    if reasoning_effort is not None and "enable_thinking" not in (requested or {}):
        extra["enable_thinking"] = reasoning_effort != "none"
    return merge_kwargs(defaults, merge_kwargs(requested, extra))


class GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block, parsed only (vLLM's ``AssistantTracker``)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=32)
def template_variables(template: str) -> frozenset[str]:
    """The variables a template reads (vLLM's ``_resolve_chat_template_kwargs``)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


@lru_cache(maxsize=1)
def _apply_chat_template_params() -> frozenset[str]:
    from transformers import PythonBackend, TokenizersBackend

    names = set()
    for fn in (TokenizersBackend.apply_chat_template, PythonBackend.apply_chat_template):
        names |= {p.name for p in inspect.signature(fn).parameters.values() if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names - {"self"})


def resolve_kwargs(template: str, kwargs: dict) -> dict:
    """vLLM's ``resolve_chat_template_kwargs``: what apply_chat_template takes by name,
    or the template reads; the rest is dropped."""
    accept = (_apply_chat_template_params() | template_variables(template)) - _UNEXPECTED
    return {k: v for k, v in kwargs.items() if k in accept}


def template_error_reason(e: BaseException) -> str:
    """vLLM's ``_template_error_reason``: the first jinja error down the cause chain, else the error."""
    seen, current = set(), e
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, jinja2.TemplateError):
            return str(current)
        current = current.__cause__ or current.__context__
    return str(e)


async def safe_apply_chat_template(tokenizer, conversation: list[dict], *, tools=None, chat_template: str | None = None,
                                   tokenize: bool = True, **kwargs) -> str | list[int]:
    """vLLM's ``safe_apply_chat_template``, in the tokenizer thread: the template
    resolved, "developer" messages made "system" ones where the template knows no such
    role, the kwargs filtered, then transformers renders; whatever it or the template
    raises is a ChatTemplateError with the reason (a 400, as vLLM)."""
    template = tokenizer.resolve_chat_template(chat_template, tools)
    if template is None:
        raise ChatTemplateError(NO_TEMPLATE)
    if any(m.get("role") == "developer" for m in conversation) and not mentions_developer_role(template):
        conversation = developer_to_system(conversation)
    resolved = resolve_kwargs(template, kwargs)
    resolved.pop("return_dict", None)  # NOTE: vLLM forces return_dict=False: ids or text, never a BatchEncoding
    try:
        return await tokenizer.apply_chat_template_async(conversation, template, tools, tokenize, **resolved)
    except Exception as e:  # noqa: BLE001 - as vLLM: what the template or transformers refused is the request's fault
        raise ChatTemplateError(template_error_reason(e)) from e


def mentions_developer_role(template: str) -> bool:
    return '"developer"' in template or "'developer'" in template


def developer_to_system(conversation: list[dict]) -> list[dict]:
    """vLLM's fallback for a template that knows no "developer" role: such messages
    become "system" ones (their tools dropped), all system messages merged into one
    first message when they are several or not first."""
    conversation = [({k: v for k, v in m.items() if k != "tools"} | {"role": "system"}) if m["role"] == "developer" else m
                    for m in conversation]
    systems, others, merge = [], [], False
    for i, m in enumerate(conversation):
        if m["role"] != "system":
            others.append(m)
            continue
        merge = merge or i > 0 or bool(systems)
        content = m.get("content", "")
        if isinstance(content, list):
            content = "\n".join(p["text"] if isinstance(p, dict) else p for p in content if isinstance(p, str) or (isinstance(p, dict) and "text" in p))
        if content:
            systems.append(content)
    return [{"role": "system", "content": "\n\n".join(systems)}, *others] if merge else conversation


# A --chat-template value with none of these is a path, never a template (vLLM's rule).
_JINJA_CHARS = "{}\n"


def chat_template_problem(value: str) -> str | None:
    """Why ``--chat-template value`` cannot be used (vLLM's ``validate_chat_template``),
    or None. NOTE: vLLM also looks a bare name up among its bundled templates; kvpool
    bundles none, so such a name must be a file."""
    if any(c in value for c in _JINJA_CHARS) or Path(value).is_file():
        return None
    return f"--chat-template {value!r} looks like a file path, but it is not a file (and not a template: it has none of {{, }} or a newline)"


def load_chat_template(value: str) -> str:
    """``--chat-template``: the file's text when ``value`` names a readable file, else
    ``value`` itself as the template (vLLM's ``load_chat_template``)."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ChatTemplateError(f"--chat-template {value}: the file is not UTF-8 text ({e})") from None
    except OSError:
        problem = chat_template_problem(value)
        if problem is not None:
            raise ChatTemplateError(problem) from None
        return value
