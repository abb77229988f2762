"""Rendering a checkpoint's chat template with jinja2 the way transformers renders it
(``transformers.utils.chat_template_utils``): a sandboxed environment with
``trim_blocks`` and ``lstrip_blocks``, the loop-control extension, transformers'
``tojson`` filter and its ``raise_exception`` / ``strftime_now`` globals; the template
sees ``messages``, ``tools``, ``documents``, ``add_generation_prompt`` and the
special tokens (``bos_token``, ``eos_token``, ...). Keys whose value is None are
dropped from each message first, as transformers does.

The rendered text is then tokenized without special tokens (the template wrote
them), as both transformers' ``apply_chat_template`` and vLLM's chat endpoint do.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """No template, or one that failed (its own raise_exception included)."""


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # NOTE: transformers' override: jinja's own tojson escapes HTML characters.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """transformers' ``{% generation %}`` block, rendered as its body."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


@lru_cache(maxsize=8)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"the chat template does not compile: {e}") from None


def render_chat(
    template: str | None,
    messages: list[dict],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    documents: list[dict] | None = None,
    **kwargs,
) -> str:
    """The prompt text of ``messages``; ``kwargs`` are vLLM's ``chat_template_kwargs``."""
    if template is None:
        raise ChatTemplateError(
            "As of transformers v4.44, default chat template is no longer allowed, so you must provide "
            "a chat template if the tokenizer does not define one."
        )
    chat = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        return compile_template(template).render(
            messages=chat, tools=tools, documents=documents, add_generation_prompt=add_generation_prompt,
            **{**special_tokens, **kwargs},
        )
    except jinja2.TemplateError as e:
        raise ChatTemplateError(str(e)) from None


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
