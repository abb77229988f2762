"""Tokenizing, chat templates and detokenizing as vLLM 0.32 does them, against a live
`kvpool serve` of a checkpoint with a SentencePiece-style (Metaspace) tokenizer
(tests/kvtest/local_tokenizers.py): expected values come from transformers (what vLLM
runs) and from vLLM's source, cited where used. Each was also checked by hand against
a live `vllm serve` of the same checkpoint."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request

import pytest

CHAT = [{"role": "user", "content": "hi"}]
CONTINUED = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "the cat"}]
GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    from kvtest.local_tokenizers import metaspace_checkpoint

    return metaspace_checkpoint(tiny_checkpoint, tmp_path_factory.mktemp("metaspace"))


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(checkpoint))


@pytest.fixture(scope="module")
def served(checkpoint, tmp_path_factory):
    from kvtest.serve import kvpool_serve

    with kvpool_serve(checkpoint, tmp_path_factory.mktemp("serve-logs"), "--max-model-len", "1024") as s:
        yield s


def post(served, path: str, body: dict, timeout: float = 60) -> tuple[int, dict]:
    req = urllib.request.Request(served.base_url + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def stream_chunks(served, body: dict) -> list[dict]:
    req = urllib.request.Request(served.base_url + "/v1/chat/completions", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().splitlines()
    return [json.loads(x[6:]) for x in lines if x.startswith("data: ") and x != "data: [DONE]"]


def test_an_answer_keeps_its_leading_space_as_vllm_decodes_it(served, hf):
    """vLLM seeds its DecodeStream with the prompt: the text is transformers' decode of
    prompt + output less the prompt's (a Metaspace decoder drops the first word's space
    only at the start of a text)."""
    status, body = post(served, "/v1/completions", {"prompt": "the cat", **GREEDY, "logprobs": 0, "return_tokens_as_token_ids": True})
    assert status == 200, body
    choice = body["choices"][0]
    out = [int(t.split(":")[1]) for t in choice["logprobs"]["tokens"]]
    prompt = hf("the cat").input_ids
    expected = hf.decode(prompt + out, skip_special_tokens=True)[len(hf.decode(prompt, skip_special_tokens=True)):]
    assert choice["text"] == expected


def test_a_stop_token_adds_no_text_unless_included(served, hf):
    """vLLM's detokenizer skips the token that stopped the request (stop_token_ids)."""
    _, body = post(served, "/v1/completions", {"prompt": "the cat", **GREEDY, "logprobs": 0, "return_tokens_as_token_ids": True})
    out = [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]
    prompt = hf("the cat").input_ids
    stop = out[2]
    first = out.index(stop)

    def text(n):
        return hf.decode(prompt + out[:n], skip_special_tokens=True)[len(hf.decode(prompt, skip_special_tokens=True)):]

    for include, expected in ((False, text(first)), (True, text(first + 1))):
        _, body = post(served, "/v1/completions", {"prompt": "the cat", **GREEDY, "stop_token_ids": [stop], "include_stop_str_in_output": include})
        assert (body["choices"][0]["text"], body["choices"][0]["stop_reason"]) == (expected, stop)


def test_chat_add_special_tokens_tokenizes_the_rendered_text_with_them(served, hf):
    """vLLM renders the template to text (tokenize=False), then tokenizes it with the
    request's add_special_tokens: here the post-processor's <s> comes first."""
    text = hf.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    for add in (False, True):
        status, body = post(served, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "add_special_tokens": add})
        assert status == 200, body
        assert body["usage"]["prompt_tokens"] == len(hf(text, add_special_tokens=add).input_ids)
    assert len(hf(text).input_ids) == len(hf(text, add_special_tokens=False).input_ids) + 1


def test_request_fields_win_over_chat_template_kwargs(served, hf):
    """vLLM's build_chat_params merges add_generation_prompt over chat_template_kwargs'
    (a 500 TypeError in kvpool before); a kwarg the template reads reaches it."""
    with_prompt = len(hf.apply_chat_template(CHAT, add_generation_prompt=True, return_dict=False))
    for kwargs in ({"add_generation_prompt": False}, {"tools": [{"type": "function"}]}, {"documents": None, "unknown": 1}):
        status, body = post(served, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "chat_template_kwargs": kwargs})
        assert (status, body["usage"]["prompt_tokens"]) == (200, with_prompt), kwargs


@pytest.mark.parametrize(("body", "message", "param"), [
    ({"chat_template_kwargs": {"messages": []}}, "jinja2.environment.Template.render() got multiple values for keyword argument 'messages'", None),
    ({"chat_template_kwargs": {"conversation": []}}, "safe_apply_chat_template() got multiple values for argument 'conversation'", None),
    # vLLM's own check only when both were sent; else transformers' refusal
    ({"continue_final_message": True, "add_generation_prompt": True},
     "Cannot set both `continue_final_message` and `add_generation_prompt` to True.", None),
    ({"continue_final_message": True}, "continue_final_message and add_generation_prompt are not compatible. Use continue_final_message "
     "when you want the model to continue the final message, and add_generation_prompt when you want to add a header that will "
     "prompt it to start a new assistant message instead.", None),
    ({"chat_template": "{{ messages[0].content }}"}, "Chat template is passed with request, but --trust-request-chat-template is not "
     "set. Refused request with untrusted chat template.", None),
    ({"chat_template_kwargs": {"chat_template": "x"}}, "Chat template is passed with request, but --trust-request-chat-template is "
     "not set. Refused request with untrusted chat template.", None),
    ({"mm_processor_kwargs": {"a": 1}}, "Per-request mm_processor_kwargs are disabled by default because they can change multimodal "
     "preprocessing resource usage. Start the server with --trust-request-mm-kwargs only when clients are trusted. "
     "(parameter=mm_processor_kwargs)", "mm_processor_kwargs"),
    ({"media_io_kwargs": {"image": {}}}, "Per-request media_io_kwargs are disabled by default because they can change multimodal "
     "media loading resource usage. Start the server with --trust-request-mm-kwargs only when clients are trusted. "
     "(parameter=media_io_kwargs)", "media_io_kwargs"),
])
def test_refusals_are_vllms(served, body, message, param):
    """Messages as a live vLLM 0.32 answered them for the same requests."""
    status, got = post(served, "/v1/chat/completions", {"messages": CHAT, **GREEDY, **body})
    assert (status, got["error"]["message"], got["error"]["param"]) == (400, message, param)


def test_continue_final_message_and_echo(served, hf):
    """vLLM: with echo, the last message's content comes first when its role is the
    reply's (the continued assistant message here); streamed, as one chunk after the
    role chunk."""
    body = {"messages": CONTINUED, **GREEDY, "echo": True, "add_generation_prompt": False, "continue_final_message": True}
    status, got = post(served, "/v1/chat/completions", body)
    assert status == 200, got
    prompt = hf.apply_chat_template(CONTINUED, continue_final_message=True, return_dict=False)
    assert got["usage"]["prompt_tokens"] == len(prompt)
    content = got["choices"][0]["message"]["content"]
    assert content.startswith("the cat") and got["choices"][0]["message"]["role"] == "assistant"
    chunks = stream_chunks(served, body)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert chunks[1]["choices"] == [{"index": 0, "delta": {"content": "the cat"}, "logprobs": None, "finish_reason": None}]
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"]) == content
    # The reply's role (assistant) is not the last message's (user): nothing is echoed.
    _, plain = post(served, "/v1/chat/completions", {"messages": CHAT, **GREEDY})
    _, echoed = post(served, "/v1/chat/completions", {"messages": CHAT, **GREEDY, "echo": True})
    assert echoed["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
def served_long(checkpoint, tmp_path_factory):
    """The checkpoint's whole context: a million characters stay under the character
    bound vLLM refuses before tokenizing (max_model_len x the longest token's length)."""
    from kvtest.serve import kvpool_serve

    with kvpool_serve(checkpoint, tmp_path_factory.mktemp("serve-long-logs"), "--max-model-len", "131072", "--kv-cache-memory", "300MiB") as s:
        yield s


def test_the_event_loop_serves_health_while_a_huge_prompt_is_tokenized(served_long, hf):
    """Tokenizing runs in the tokenizer thread, as vLLM's renderer: /health keeps
    answering while a prompt of a million characters is tokenized (then refused as too long)."""
    served = served_long
    big = "the cat sat on the mat 2024 hello world. " * 25_000
    assert len(big) < 131072 * max(len(t) for t in hf.get_vocab())
    result = {}

    def send():
        result["answer"] = post(served, "/v1/completions", {"prompt": big, "max_tokens": 1}, timeout=120)
        result["end"] = time.monotonic()

    sender = threading.Thread(target=send)
    start = time.monotonic()
    sender.start()
    answered = []
    while sender.is_alive() and time.monotonic() - start < 120:
        with urllib.request.urlopen(served.base_url + "/health", timeout=30) as r:
            assert r.status == 200
        answered.append(time.monotonic())
        time.sleep(0.02)
    sender.join(30)
    status, body = result["answer"]
    assert status == 400 and "maximum context length" in body["error"]["message"]
    during = [t for t in answered if t < result["end"]]
    # NOTE: a loop blocked by the tokenizer answers at most the one /health already sent.
    assert len(during) >= 3, f"{len(during)} /health answers while the prompt was tokenized for {result['end'] - start:.2f}s"


def test_a_qwen2_checkpoint_is_tokenized_as_transformers_builds_its_tokenizer(tiny_checkpoint, tmp_path):
    """transformers 5 gives a qwen2 config Qwen2's tokenizer (digits one by one) whatever
    tokenizer.json's pre-tokenizer: kvpool serve's /tokenize gives AutoTokenizer's ids,
    as vLLM's get_tokenizer does, not the file's."""
    import shutil

    from kvtest.hf_models import make_checkpoint
    from kvtest.local_tokenizers import qwen2_checkpoint
    from kvtest.serve import kvpool_serve
    from tokenizers import Tokenizer as RawTokenizer
    from transformers import AutoTokenizer

    d = make_checkpoint("qwen2", tmp_path / "qwen2")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(qwen2_checkpoint(tiny_checkpoint, tmp_path / "tok") / name, d / name)
    text = "in 2024 there were 12345 cats"
    expected = AutoTokenizer.from_pretrained(str(d))(text).input_ids
    assert expected != RawTokenizer.from_file(str(d / "tokenizer.json")).encode(text).ids
    with kvpool_serve(d, tmp_path / "logs") as s:
        status, body = post(s, "/tokenize", {"prompt": text})
    assert (status, body["tokens"]) == (200, expected)


def test_detokenize_and_a_token_prompts_echo_keep_special_tokens(served, hf):
    """vLLM decodes a token prompt with transformers' default (special tokens kept): a
    live vLLM 0.32 answered "<s> the cat</s><|user|>" to both for these ids."""
    ids = [hf.convert_tokens_to_ids("<s>"), *hf("the cat", add_special_tokens=False).input_ids,
           hf.convert_tokens_to_ids("</s>"), hf.convert_tokens_to_ids("<|user|>")]
    expected = hf.decode(ids)
    assert expected == "<s> the cat</s><|user|>"
    assert post(served, "/detokenize", {"tokens": ids}) == (200, {"prompt": expected})
    status, body = post(served, "/v1/completions", {"prompt": ids, "echo": True, **GREEDY})
    assert status == 200 and body["choices"][0]["text"].startswith(expected)
