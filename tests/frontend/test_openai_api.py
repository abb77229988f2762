"""The openai SDK against a live `kvpool serve` of the tiny generated checkpoint.

Expected texts come from transformers (greedy generation in float32 on the same
checkpoint, its AutoTokenizer), never from the server itself.
"""

from __future__ import annotations

import json
import urllib.request

import pytest
from kvtest.http_api import PROMPT, post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")

BLOCK = 16


def hf_greedy(hf, ids: list[int], max_new_tokens: int) -> list[int]:
    tok, m = hf
    with torch.no_grad():
        out = m.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.eos_token_id, attention_mask=torch.ones(1, len(ids), dtype=torch.long))
    return out[0, len(ids):].tolist()


# --- models, health, version -----------------------------------------------------------


def test_ready_line_names_model_url_and_pool(served, tiny_checkpoint):
    line = served.ready_line
    assert str(tiny_checkpoint) in line and served.base_url in line
    assert "256 blocks × 16 tokens, 8.0 MiB" in line  # 8 MiB / (2 * 4 layers * 16 * 2 heads * 32 * 4 B)


def test_models_lists_the_model_as_given(client, model):
    (card,) = client.models.list().data
    assert card.id == model and card.root == model and card.model_extra["max_model_len"] == 1024


def test_health_and_version(served):
    assert urllib.request.urlopen(served.base_url + "/health", timeout=10).status == 200
    version = json.loads(urllib.request.urlopen(served.base_url + "/version", timeout=10).read())
    # vLLM clients parse "version": the vLLM API this is; kvpool's own beside it.
    assert version == {"version": "0.32.0", "kvpool_version": "0.1.0"}


# --- greedy equals transformers --------------------------------------------------------


def test_greedy_completion_equals_transformers(client, model, hf):
    tok, _ = hf
    expected = hf_greedy(hf, tok(PROMPT).input_ids, 24)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, logprobs=0,
                                  extra_body={"return_tokens_as_token_ids": True})
    ids = [int(t.removeprefix("token_id:")) for t in r.choices[0].logprobs.tokens]
    assert ids == expected
    assert r.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(tok(PROMPT).input_ids) and r.usage.completion_tokens == len(expected)


def test_greedy_chat_equals_transformers(client, model, hf):
    tok, _ = hf
    messages = [{"role": "system", "content": "Réponds brièvement ✓"}, {"role": "user", "content": "Où est le cache? 日本"}]
    prompt_ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt_ids = prompt_ids["input_ids"] if not isinstance(prompt_ids, list) else prompt_ids
    expected = hf_greedy(hf, prompt_ids, 16)
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    assert r.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert r.usage.prompt_tokens == len(prompt_ids)


def test_token_id_prompts_and_prompt_lists(client, model, hf):
    tok, _ = hf
    ids = tok("a list of prompts").input_ids
    r = client.completions.create(model=model, prompt=[PROMPT, ids], max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].text == tok.decode(hf_greedy(hf, tok(PROMPT).input_ids, 6), skip_special_tokens=True)
    # NOTE: as vLLM's DecodeStream, an answer that ends inside a character ends without it
    # (a live vLLM 0.32 answered "f\ufffd\ufffd n" here; the one-shot decode ends in one more U+FFFD).
    assert r.choices[1].text == tok.decode(hf_greedy(hf, ids, 6), skip_special_tokens=True).rstrip("\ufffd")


# --- streaming, usage, cached tokens -------------------------------------------------


def test_streamed_text_equals_the_whole_response_and_usage_comes_last(client, model):
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_streamed_chat_starts_with_the_role(client, model):
    chunks = list(client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                                 temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    whole = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_a_repeated_prompt_reports_its_cached_tokens(client, model, hf):
    tok, _ = hf
    prompt = "cached tokens: " + PROMPT * 3
    n = len(tok(prompt).input_ids)
    client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    r = client.completions.create(model=model, prompt=prompt, max_tokens=2, temperature=0)
    # Full blocks only, and the last prompt token is always computed.
    assert r.usage.prompt_tokens_details.cached_tokens == (n - 1) // BLOCK * BLOCK > 0


# --- stop strings, n, seeds, logprobs ------------------------------------------------


def test_stop_string_cuts_the_text(client, model, hf):
    tok, _ = hf
    full = tok.decode(hf_greedy(hf, tok(PROMPT).input_ids, 24), skip_special_tokens=True)
    stop = full[6:9]
    assert stop and full.index(stop) == 6
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop])
    assert r.choices[0].text == full[:6]
    assert r.choices[0].finish_reason == "stop" and r.choices[0].model_extra["stop_reason"] == stop
    streamed = client.completions.create(model=model, prompt=PROMPT, max_tokens=24, temperature=0, stop=stop, stream=True)
    assert "".join(c.choices[0].text for c in streamed) == full[:6]


def test_n_samples_seeded_and_reproducible(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=12, temperature=1.0, n=3, seed=1234, extra_body={"ignore_eos": True})
    a = client.completions.create(**kw)
    b = client.completions.create(**kw)
    assert sorted(c.index for c in a.choices) == [0, 1, 2]
    assert [c.text for c in sorted(a.choices, key=lambda c: c.index)] == [c.text for c in sorted(b.choices, key=lambda c: c.index)]
    assert len({c.text for c in a.choices}) > 1  # seed + index: the samples differ
    assert a.usage.completion_tokens == 36


def test_logprobs_shapes(client, model):
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=3, extra_body={"ignore_eos": True})
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    c = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = c.choices[0].logprobs.content
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the sampled token is the most likely one
    assert all(t.logprob == pytest.approx(t.top_logprobs[0].logprob) for t in content)


def test_streamed_logprobs_and_continuous_usage_equal_the_whole_response(client, model):
    kw = dict(model=model, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0].logprobs
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True,
                                                                              "continuous_usage_stats": True}))
    streamed = [c for c in chunks if c.choices]
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed) == 6
    assert [t for c in streamed for t in c.choices[0].logprobs.tokens] == whole.tokens
    assert [x for c in streamed for x in c.choices[0].logprobs.token_logprobs] == pytest.approx(whole.token_logprobs)
    assert [x for c in streamed for x in c.choices[0].logprobs.text_offset] == whole.text_offset
    # every chunk carries the usage so far; the completion tokens only grow, to 6
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 6 and all(c.usage.prompt_tokens == chunks[0].usage.prompt_tokens for c in chunks)
    messages = [{"role": "user", "content": "x"}]
    chat = client.chat.completions.create(model=model, messages=messages, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2,
                                          stream=True, extra_body={"ignore_eos": True})
    content = [t for c in chat if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert len(content) == 4 and all(len(t.top_logprobs) == 2 for t in content)


# --- tokenize / detokenize -----------------------------------------------------------


def test_tokenize_and_detokenize_equal_transformers(served, hf):
    tok, _ = hf
    text = "héllo 世界 🎉 <|eos|>"
    status, body = post(served, "/tokenize", {"prompt": text})
    assert status == 200 and body["tokens"] == tok(text).input_ids and body["count"] == len(body["tokens"])
    messages = [{"role": "user", "content": text}]
    status, body = post(served, "/tokenize", {"messages": messages})
    expected = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    assert body["tokens"] == (expected if isinstance(expected, list) else expected["input_ids"])
    status, body = post(served, "/detokenize", {"tokens": tok(text).input_ids})
    # NOTE: vLLM decodes with transformers' default, special tokens kept (a live vLLM 0.32
    # answered "<s> the cat</s><|user|>" for [<s>, the, cat, </s>, <|user|>])
    assert status == 200 and body["prompt"] == tok.decode(tok(text).input_ids) == "héllo 世界 🎉 <|eos|>"


def test_echo_and_streamed_n(client, model, hf):
    tok, _ = hf
    expected = tok.decode(hf_greedy(hf, tok(PROMPT).input_ids, 5), skip_special_tokens=True)
    r = client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, echo=True)
    assert r.choices[0].text == PROMPT + expected
    # vLLM's _verify_greedy_sampling: n greedy samples would be one sample n times
    with pytest.raises(openai.BadRequestError, match=r"n must be 1 when using greedy sampling, got 2\."):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=0, n=2, stream=True)
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=5, temperature=1.0, seed=5, n=2, stream=True,
                                            extra_body={"ignore_eos": True}))
    for i in (0, 1):
        assert "".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i)
    assert sorted(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason) == ["length", "length"]


def test_two_requests_with_one_x_request_id_both_complete(client, model):
    """A retry or a router may reuse a request id while the first is still running: each
    engine request has an id of its own, so neither gets the other's end (vLLM's suffix)."""
    from concurrent.futures import ThreadPoolExecutor

    def complete(_):
        return client.completions.create(model=model, prompt="same id", max_tokens=24, temperature=0,
                                         extra_body={"ignore_eos": True}, extra_headers={"X-Request-Id": "shared"})

    with ThreadPoolExecutor(2) as pool:
        a, b = pool.map(complete, range(2))
    assert a.id == b.id == "cmpl-shared"
    assert a.usage.completion_tokens == b.usage.completion_tokens == 24 and a.choices[0].text == b.choices[0].text
