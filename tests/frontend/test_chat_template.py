"""frontend.chat_template against transformers' apply_chat_template."""

from __future__ import annotations

import pytest
from kvtest.unicode_texts import TEXTS

from frontend.chat_template import ChatTemplateError, render_chat
from frontend.tokenizer import Tokenizer

CHATS = [
    [{"role": "user", "content": t}] for t in TEXTS
] + [
    [{"role": "system", "content": "  Be brief. ✓ "}, {"role": "user", "content": "Qu'est-ce que c'est? 日本"},
     {"role": "assistant", "content": "Un cache 🎉"}, {"role": "user", "content": "encore"}],
    [{"role": "user", "content": "a", "name": None}],
]


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("which", ["tiny", "bos"])
def test_render_and_tokenize_equal_transformers(tiny_checkpoint, bos_checkpoint, chat, add_generation_prompt, which):
    from transformers import AutoTokenizer

    d = tiny_checkpoint if which == "tiny" else bos_checkpoint
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer(d)
    text = render_chat(tok.chat_template, chat, tok.special_tokens_map, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert tok.encode(text, add_special_tokens=False) == expected_ids


def test_template_features_transformers_provides():
    template = (
        "{% for m in messages %}{% if m['role'] == 'skip' %}{% continue %}{% endif %}"
        "{{ m | tojson }}{% endfor %}{% if tools %}{{ raise_exception('no tools here') }}{% endif %}"
    )
    out = render_chat(template, [{"role": "skip", "content": "x"}, {"role": "user", "content": "<é>"}], {})
    assert out == '{"role": "user", "content": "<é>"}'
    with pytest.raises(ChatTemplateError, match="no tools here"):
        render_chat(template, [], {}, tools=[{"type": "function"}])


def test_no_template_is_a_clear_error():
    with pytest.raises(ChatTemplateError, match="must provide a chat template"):
        render_chat(None, [{"role": "user", "content": "hi"}], {})
    with pytest.raises(ChatTemplateError, match="does not compile"):
        render_chat("{% for %}", [], {})


def test_the_sandbox_refuses_reaching_python_internals():
    with pytest.raises(Exception, match="unsafe|not safely|SecurityError|access"):
        render_chat("{{ messages.__class__.__mro__ }}{{ ''.__class__.__subclasses__() }}", [], {})


def test_chat_template_flag_is_a_file_or_the_template_itself(tmp_path):
    from frontend.chat_template import chat_template_problem, load_chat_template

    f = tmp_path / "t.jinja"
    f.write_text("{{ messages[0]['content'] }}")
    assert load_chat_template(str(f)) == "{{ messages[0]['content'] }}"
    assert load_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}") == "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert load_chat_template("line one\nline two") == "line one\nline two"  # a newline makes it a template, as in vLLM
    missing = str(tmp_path / "missing.jinja")
    assert "looks like a file path" in chat_template_problem(missing)
    with pytest.raises(ChatTemplateError, match="looks like a file path"):
        load_chat_template(missing)
    (tmp_path / "latin1.jinja").write_bytes(b"caf\xe9 {{ x }}")
    with pytest.raises(ChatTemplateError, match="not UTF-8"):
        load_chat_template(str(tmp_path / "latin1.jinja"))
