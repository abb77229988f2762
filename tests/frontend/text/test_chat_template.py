"""frontend.text.chat_template against transformers' apply_chat_template and vLLM 0.32's
rules for the kwargs (``vllm/renderers/hf.py``, ``params.py``, the chat protocol's
``build_chat_params``), worked out by hand from its source."""

from __future__ import annotations

import asyncio

import pytest
from kvtest.unicode_texts import TEXTS

from frontend.text.chat_template import (
    ChatTemplateError,
    chat_template_kwargs,
    developer_to_system,
    merge_kwargs,
    resolve_kwargs,
    safe_apply_chat_template,
)
from frontend.text.tokenizer import Tokenizer

CHATS = [
    [{"role": "user", "content": t}] for t in TEXTS
] + [
    [{"role": "system", "content": "  Be brief. ✓ "}, {"role": "user", "content": "Qu'est-ce que c'est? 日本"},
     {"role": "assistant", "content": "Un cache 🎉"}, {"role": "user", "content": "encore"}],
    [{"role": "user", "content": "a", "name": None}],
]


def apply(tok, chat, **kwargs):
    return asyncio.run(safe_apply_chat_template(tok, chat, **kwargs))


@pytest.mark.parametrize("chat", CHATS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("which", ["tiny", "bos"])
def test_render_and_tokenize_equal_transformers(tiny_checkpoint, bos_checkpoint, chat, add_generation_prompt, which):
    from transformers import AutoTokenizer

    d = tiny_checkpoint if which == "tiny" else bos_checkpoint
    hf = AutoTokenizer.from_pretrained(str(d))
    tok = Tokenizer(d)
    text = apply(tok, chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert text == hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
    expected_ids = hf.apply_chat_template(chat, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False)
    assert apply(tok, chat, tokenize=True, add_generation_prompt=add_generation_prompt) == expected_ids
    assert tok.encode(text, add_special_tokens=False) == expected_ids


def test_merge_kwargs_as_vllm():
    """A None or "auto" override leaves the default; anything else (False too) wins."""
    assert merge_kwargs({"a": 1, "b": 2, "c": 3}, {"a": None, "b": "auto", "c": False, "d": 0}) == {"a": 1, "b": 2, "c": False, "d": 0}
    assert merge_kwargs(None, None) == {}


def test_request_fields_win_over_chat_template_kwargs_which_win_over_the_servers():
    """vLLM: build_chat_params merges the request's add_generation_prompt,
    continue_final_message and documents over its chat_template_kwargs, then
    with_defaults puts that over --default-chat-template-kwargs plus the server's
    tools and tokenize=False."""
    server = {"enable_thinking": False, "x": 1, "tools": ["server"], "documents": ["server"]}
    requested = {"enable_thinking": True, "add_generation_prompt": False, "messages": [], "tools": ["kwargs"], "x": None}
    got = chat_template_kwargs(server, None, requested, True, False, None)
    assert got == {"enable_thinking": True, "x": 1, "tools": ["kwargs"], "documents": ["server"], "tokenize": False,
                   "add_generation_prompt": True, "continue_final_message": False, "messages": []}
    got = chat_template_kwargs({}, [{"t": 1}], None, False, True, [{"d": 1}])
    assert got == {"tools": [{"t": 1}], "tokenize": False, "add_generation_prompt": False, "continue_final_message": True,
                   "documents": [{"d": 1}]}


def test_only_kwargs_apply_chat_template_takes_or_the_template_reads_pass():
    template = "{{ messages[0].content }}{% if enable_thinking %}T{% endif %}"
    kwargs = {"enable_thinking": True, "unknown": 1, "documents": [], "add_generation_prompt": True, "chat_template": "x", "tokenize": True}
    assert resolve_kwargs(template, kwargs) == {"enable_thinking": True, "documents": [], "add_generation_prompt": True}


def test_a_template_variable_from_chat_template_kwargs_reaches_the_template(tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    tok.chat_template = "{{ messages[0]['content'] }}|{{ flavour }}|{{ documents[0].title }}"
    docs = [{"title": "t", "text": "x"}]
    assert apply(tok, [{"role": "user", "content": "hi"}], tokenize=False, flavour="mint", documents=docs) == "hi|mint|t"


def test_refusals_carry_the_templates_or_transformers_reason(tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    chat = [{"role": "user", "content": "hi"}]
    with pytest.raises(ChatTemplateError, match="multiple values for keyword argument 'messages'"):
        apply(tok, chat, messages=[])
    with pytest.raises(ChatTemplateError, match="continue_final_message and add_generation_prompt are not compatible"):
        apply(tok, chat, add_generation_prompt=True, continue_final_message=True)
    tok.chat_template = "{{ raise_exception('no thanks') }}"
    with pytest.raises(ChatTemplateError, match="^no thanks$"):
        apply(tok, chat)
    tok.chat_template = None
    with pytest.raises(ChatTemplateError, match="must provide a chat template"):
        apply(tok, chat)


def test_continue_final_message_leaves_the_last_message_open(tiny_checkpoint):
    from transformers import AutoTokenizer

    tok, hf = Tokenizer(tiny_checkpoint), AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]
    text = apply(tok, chat, tokenize=False, add_generation_prompt=False, continue_final_message=True)
    assert text == hf.apply_chat_template(chat, tokenize=False, continue_final_message=True) and text.endswith("the cat")


def test_developer_messages_become_one_first_system_message_as_vllm():
    chat = [{"role": "user", "content": "a"}, {"role": "developer", "content": "be nice", "tools": [1]},
            {"role": "system", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "y"}]}]
    assert developer_to_system(chat) == [{"role": "system", "content": "be nice\n\nx\ny"}, {"role": "user", "content": "a"}]
    lone = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert developer_to_system(lone) == [{"role": "system", "content": "d"}, {"role": "user", "content": "u"}]


def test_a_template_without_the_developer_role_sees_system(tiny_checkpoint):
    tok = Tokenizer(tiny_checkpoint)
    tok.chat_template = "{% for m in messages %}{{ m.role }}:{{ m.content }};{% endfor %}"
    chat = [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}]
    assert apply(tok, chat, tokenize=False) == "system:d;user:u;"
    tok.chat_template += "{# 'developer' #}"
    assert apply(tok, chat, tokenize=False) == "developer:d;user:u;"


def test_chat_template_flag_is_a_file_or_the_template_itself(tmp_path):
    from frontend.text.chat_template import chat_template_problem, load_chat_template

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


def _ctx(tok, trust: bool, defaults: dict | None = None):
    from types import SimpleNamespace

    config = SimpleNamespace(trust_request_chat_template=trust, default_chat_template_kwargs=defaults or {},
                             chat_template_content_format="auto")
    return SimpleNamespace(tokenizer=tok, config=config)


def test_a_request_template_only_with_the_trust_flag_and_in_vllms_order(tiny_checkpoint):
    """vLLM: the request's chat_template, else --chat-template, else
    chat_template_kwargs' chat_template, else the checkpoint's; a template from the
    request is refused without --trust-request-chat-template."""
    from frontend.openai.chat_prompt import chat_prompt
    from frontend.schema.errors import APIError

    tok = Tokenizer(tiny_checkpoint)

    def text(ctx, **kw):
        ids, _ = asyncio.run(chat_prompt(ctx, [{"role": "user", "content": "hi"}], True, False, **kw))
        return tok.decode(ids, skip_special_tokens=False)

    trusted = _ctx(tok, True)
    assert text(trusted, chat_template="R{{ messages[0].content }}", chat_template_kwargs={"chat_template": "K"}) == "Rhi"
    assert text(trusted, chat_template_kwargs={"chat_template": "K{{ messages[0].content }}"}) == "Khi"
    assert text(trusted) == "<|bos|><|user|>hi<|eos|><|assistant|>"
    tok.chat_template, tok.chat_template_from_flag = "F{{ messages[0].content }}", True  # --chat-template
    assert text(trusted, chat_template_kwargs={"chat_template": "K"}) == "Fhi"
    assert text(trusted, chat_template="R{{ messages[0].content }}") == "Rhi"
    for kw in ({"chat_template": "R"}, {"chat_template_kwargs": {"chat_template": "K"}}):
        with pytest.raises(APIError, match="--trust-request-chat-template is not set"):
            text(_ctx(tok, False), **kw)
    # --default-chat-template-kwargs sit under the request's
    tok.chat_template = "{{ a }}{{ b }}"
    assert text(_ctx(tok, False, {"a": 1, "b": 2}), chat_template_kwargs={"b": 3, "a": None}) == "13"


def test_the_flag_reaches_the_frontend_config():
    from frontend.config import build_parser

    assert build_parser().parse_args(["--model", "m", "--trust-request-chat-template"]).trust_request_chat_template is True
    assert build_parser().parse_args(["--model", "m"]).trust_request_chat_template is False


def test_reasoning_effort_is_a_template_variable_and_sets_enable_thinking_as_vllm():
    """vLLM's build_chat_params: reasoning_effort joins the kwargs, and turns
    enable_thinking on (off for "none") unless chat_template_kwargs names it."""
    assert chat_template_kwargs({}, None, None, True, False, None, "low") == {
        "tokenize": False, "add_generation_prompt": True, "continue_final_message": False, "reasoning_effort": "low",
        "enable_thinking": True}
    assert chat_template_kwargs({}, None, None, True, False, None, "none")["enable_thinking"] is False
    # named by the request (even as null: then the server's default, here none, stands)
    assert "enable_thinking" not in chat_template_kwargs({}, None, {"enable_thinking": None}, True, False, None, "high")
    assert chat_template_kwargs({}, None, {"enable_thinking": False}, True, False, None, "high")["enable_thinking"] is False
    assert chat_template_kwargs({"enable_thinking": True}, None, None, True, False, None, None)["enable_thinking"] is True
