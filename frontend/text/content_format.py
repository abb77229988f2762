"""Which content format a chat template reads, detected from its syntax tree exactly as
vLLM 0.32 detects it (``vllm/renderers/hf.py``, ``_detect_content_format``):
"openai" when the template loops over a message's ``content`` (its parts, each a
``{"type": "text", "text": ...}``), else "string" (the parts joined by new lines).

The walk follows ``messages`` through assignments (``{% set m = messages %}``), the
loops over it (``{% for message in messages %}``), then loops over
``message['content']``, over a macro parameter a message's content is passed to, or
over a variable named ``content`` outside macros. NOTE: as vLLM says of its own
walk, scopes are not tracked; this is a heuristic, and ``--chat-template-content-format``
overrides it.
"""

from __future__ import annotations

from collections import deque
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from frontend.text.chat_template import GenerationTag


def _is_var(node, name: str) -> bool:
    return isinstance(node, jinja2.nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node, name: str, key: str) -> bool:
    if isinstance(node, jinja2.nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == key
    if isinstance(node, jinja2.nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node, name: str, key: str | None = None) -> bool:
    if isinstance(node, jinja2.nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, jinja2.nodes.Getitem) and isinstance(node.arg, jinja2.nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _names_bound_to(root, name: str) -> list[str]:
    """``name`` and every variable assigned from it (or a slice, filter of it), transitively."""
    names, pending = [name], deque([name])
    while pending:
        current = pending.popleft()
        for assign in root.find_all(jinja2.nodes.Assign):
            if _is_var_or_elems(assign.node, current) and isinstance(assign.target, jinja2.nodes.Name):
                names.append(assign.target.name)
                if assign.target.name != current:
                    pending.append(assign.target.name)
    return names


def _message_loop_targets(root) -> list[str]:
    messages = _names_bound_to(root, "messages")
    return [loop.target.name for loop in root.find_all(jinja2.nodes.For)
            if isinstance(loop.target, jinja2.nodes.Name) and any(_is_var_or_elems(loop.iter, m) for m in messages)]


def _macro_content_params(root, messages: list[str]) -> tuple[dict[int, set[str]], set[int]]:
    """Per loop inside a macro: the macro's parameters a message's content is passed to."""
    by_loop, in_macros = {}, set()
    for macro in root.find_all(jinja2.nodes.Macro):
        params = {a.name for a in macro.args}
        content_params = set()
        for call in root.find_all(jinja2.nodes.Call):
            if not (isinstance(call.node, jinja2.nodes.Name) and call.node.name == macro.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(macro.args) and any(_is_var_or_elems(arg, m, "content") for m in messages):
                    content_params.add(macro.args[i].name)
            for kw in call.kwargs:
                if kw.key in params and any(_is_var_or_elems(kw.value, m, "content") for m in messages):
                    content_params.add(kw.key)
        for loop in macro.find_all(jinja2.nodes.For):
            in_macros.add(id(loop))
            if content_params:
                by_loop[id(loop)] = content_params
    return by_loop, in_macros


def _loops_over_content(root) -> bool:
    messages = _message_loop_targets(root)
    by_loop, in_macros = _macro_content_params(root, messages)
    for loop in root.find_all(jinja2.nodes.For):
        if any(_is_var_or_elems(loop.iter, m, "content") for m in messages):
            return True
        if isinstance(loop.iter, jinja2.nodes.Name):
            if loop.iter.name in by_loop.get(id(loop), ()):
                return True
            if id(loop) not in in_macros and loop.iter.name == "content":
                return True
    return False


@lru_cache(maxsize=32)
def detect_content_format(template: str) -> str:
    """"openai" or "string"; a template that does not parse is "string" (vLLM's default)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[GenerationTag, jinja2.ext.loopcontrols])
    try:
        root = env.parse(template)
    except jinja2.TemplateError:
        return "string"
    return "openai" if _loops_over_content(root) else "string"
