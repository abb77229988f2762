"""frontend.text.content_format: the content format vLLM 0.32 detects for a chat template
(expected values: vLLM's own ``_detect_content_format`` run on each template)."""

from __future__ import annotations

import asyncio

import pytest

from frontend.text.chat_messages import conversation
from frontend.text.content_format import detect_content_format


@pytest.mark.parametrize(("template", "expected"), [
    ("{% for message in messages %}{{ message['content'] }}{% endfor %}", "string"),  # plain
    ("{% for message in messages %}{% for c in message['content'] %}{{ c.text }}{% endfor %}{% endfor %}", "openai"),  # parts
    ("{% set msgs = messages[1:] %}{% for m in msgs %}{% for part in m.content | list %}{{ part.text }}{% endfor %}{% endfor %}", "openai"),  # assigned_filtered
    ("{% macro render(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ render(m['content']) }}{% endfor %}", "openai"),  # macro
    ("{% macro render(x, c=none) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}{% for m in messages %}{{ render(1, c=m.content) }}{% endfor %}", "openai"),  # macro_kw
    ("{% for m in messages %}{% set content = m.content %}{% for x in content %}{{ x }}{% endfor %}{% endfor %}", "openai"),  # content_var
    ("{% for m in messages %}{% for t in tools %}{{ t }}{% endfor %}{{ m.content }}{% endfor %}", "string"),  # other_loop
    ("{% for m in messages %}", "string"),  # broken
])
def test_detected_as_vllm_detects_it(template, expected):
    assert detect_content_format(template) == expected


def test_the_openai_format_gives_the_template_parts():
    """vLLM's parse_chat_messages with wrap_dicts: every text part a dict (its unknown
    keys kept), a string one part, no content no part; a tool message's text joined."""
    got = conversation([
        {"role": "user", "content": "hi"},
        {"role": "user", "content": ["a", {"type": "text", "text": "b", "cache_control": 1, "name": "n"}]},
        {"role": "assistant", "content": None},
        {"role": "tool", "content": [{"type": "text", "text": "4"}, {"type": "text", "text": "2"}], "tool_call_id": "c"},
    ], "openai")
    assert got == [
        {"role": "user", "content": [{"type": "text", "text": "hi"}]},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b", "cache_control": 1}]},
        {"role": "assistant", "content": []},
        {"role": "tool", "content": "4\n2", "tool_call_id": "c"},
    ]


def test_a_parts_template_renders_parts_and_the_flag_overrides_it(tiny_checkpoint):
    from types import SimpleNamespace

    from frontend.openai.chat_prompt import chat_prompt
    from frontend.text.tokenizer import Tokenizer

    tok = Tokenizer(tiny_checkpoint)
    tok.chat_template = "{% for m in messages %}{% for p in m['content'] %}[{{ p.text if p is mapping else p }}]{% endfor %}{% endfor %}"

    def text(content_format):
        config = SimpleNamespace(trust_request_chat_template=False, default_chat_template_kwargs={},
                                 chat_template_content_format=content_format)
        ctx = SimpleNamespace(tokenizer=tok, config=config)
        ids, _ = asyncio.run(chat_prompt(ctx, [{"role": "user", "content": "hi"}], True, False))
        return tok.decode(ids, skip_special_tokens=False)

    assert text("auto") == text("openai") == "[hi]"
    assert text("string") == "[h][i]"  # a string iterated character by character, as vLLM with the flag
