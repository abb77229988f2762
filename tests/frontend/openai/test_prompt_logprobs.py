"""prompt_logprobs, and echo with logprobs, against a live `kvpool serve` of the tiny
checkpoint. Expected logprobs come from transformers (float32, the same checkpoint);
shapes, messages and counts from vLLM 0.32 (its serving code, and its answers to the
same requests: ``tests/bench/compare/test_prompt_logprobs.py`` checks them live)."""

from __future__ import annotations

import json
import urllib.request

import pytest
from kvtest.http_api import PROMPT, post

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

torch = pytest.importorskip("torch")

TEXT = "the cat sat on the mat"


def reference(hf, ids: list[int]) -> tuple[list[float], list[int], list[list[int]]]:
    """Per prompt position 1..P-1: its token's logprob, rank and the top-2 ids."""
    _, m = hf
    with torch.no_grad():
        lp = m(torch.tensor([ids])).logits[0, :-1].float().log_softmax(dim=-1)  # (P-1, V)
    tok = lp.gather(1, torch.tensor(ids[1:])[:, None])
    return tok[:, 0].tolist(), (lp >= tok).sum(dim=-1).tolist(), lp.topk(2, dim=-1).indices.tolist()


def test_echo_without_generation_scores_the_prompt(served, model, hf):
    ids = hf[0](TEXT)["input_ids"]
    status, body = post(served, "/v1/completions", {"model": model, "prompt": TEXT, "max_tokens": 0, "echo": True, "logprobs": 2})
    assert status == 200
    (c,) = body["choices"]
    lp = c["logprobs"]
    # The prompt alone: its text, its tokens (the first one without a logprob).
    assert c["text"] == TEXT and "".join(lp["tokens"]) == TEXT and len(lp["tokens"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    want, _, _ = reference(hf, ids)
    assert lp["token_logprobs"][1:] == pytest.approx(want, abs=1e-4)
    # Each position: the prompt token, then the top 2 (3 entries unless it is among them).
    assert all(len(t) in (2, 3) for t in lp["top_logprobs"][1:])
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    # As vLLM: one token was sampled (and is not shown); echo asks for prompt logprobs, so the field is there too.
    assert c["finish_reason"] == "length" and body["usage"]["completion_tokens"] == 1
    assert len(c["prompt_logprobs"]) == len(ids) and c["prompt_logprobs"][0] is None


def test_echo_of_token_ids_keeps_special_tokens(served, model, hf):
    """vLLM decodes a token-id prompt for echo with the tokenizer's own decode: special
    tokens stay (here the tiny checkpoint's <|system|> and <|user|>, ids 2 and 3)."""
    ids = [100, 2, 3, 200]
    status, body = post(served, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 0, "echo": True})
    assert status == 200 and body["choices"][0]["text"] == hf[0].decode(ids)
    assert "<|system|><|user|>" in body["choices"][0]["text"]


def test_prompt_logprobs_field_ranks_and_top_k(served, model, hf):
    ids = hf[0](TEXT)["input_ids"]
    status, body = post(served, "/v1/completions", {"model": model, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 2})
    assert status == 200
    (c,) = body["choices"]
    assert c["logprobs"] is None
    plp = c["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    want, ranks, top = reference(hf, ids)
    for i, entry in enumerate(plp[1:]):
        keys = list(entry)
        # The prompt token first, then the top-2 (ranks 1, 2) it may be one of.
        assert keys[0] == str(ids[i + 1])
        assert entry[keys[0]]["logprob"] == pytest.approx(want[i], abs=1e-4)
        assert entry[keys[0]]["rank"] == ranks[i]
        assert keys[1:] == [str(t) for t in top[i] if str(t) != keys[0]]
        assert entry[str(top[i][0])]["rank"] == 1 and entry[str(top[i][1])]["rank"] == 2


def stream_chunks(served, body: dict) -> list[dict]:
    req = urllib.request.Request(served.base_url + "/v1/completions", json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        lines = r.read().decode().split("\n")
    return [json.loads(line[6:]) for line in lines if line.startswith("data: ") and line != "data: [DONE]"]


def test_echo_with_generation_streamed_equals_whole(served, model):
    body = {"model": model, "prompt": TEXT, "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0, "ignore_eos": True}
    status, whole = post(served, "/v1/completions", body)
    assert status == 200
    lp = whole["choices"][0]["logprobs"]
    chunks = [c["choices"][0] for c in stream_chunks(served, body)]
    # The first chunk: the prompt and the first token, their logprobs from offset 0.
    assert chunks[0]["text"].startswith(TEXT) and chunks[0]["logprobs"]["text_offset"][0] == 0
    assert chunks[0]["logprobs"]["token_logprobs"][0] is None
    joined = {k: [v for c in chunks for v in c["logprobs"][k]] for k in ("tokens", "token_logprobs", "text_offset")}
    assert joined["tokens"] == lp["tokens"] and joined["text_offset"] == lp["text_offset"]
    assert joined["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:], abs=1e-5)
    # The prompt's tokens, then the 4 generated.
    assert len(lp["tokens"]) == whole["usage"]["prompt_tokens"] + 4


@pytest.mark.parametrize(("body", "param", "message"), [
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "`prompt_logprobs` are not available when `stream=True`."),
    ({"prompt_logprobs": -2}, "prompt_logprobs", "`prompt_logprobs` must be a positive value or -1."),
    ({"prompt_logprobs": -1}, "prompt_logprobs", "Requested prompt logprobs of 512, which is greater than max allowed: 20"),
    ({"prompt_logprobs": 21}, "prompt_logprobs", "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ({"logprobs": -1}, "logprobs", "Requested sample logprobs of 512, which is greater than max allowed: 20"),
    ({"logprobs": -3}, "logprobs", "`logprobs` must be a positive value or -1."),
    ({"max_tokens": 0}, "max_tokens", "max_tokens must be at least 1, got 0."),
])
def test_refusals_name_the_field(served, model, body, param, message):
    status, err = post(served, "/v1/completions", {"model": model, "prompt": "abc def", "max_tokens": 2, **body})
    assert status == 400
    assert err["error"]["param"] == param and err["error"]["message"] == message


def test_prompt_logprobs_zero_streams(served, model):
    """0 is allowed with stream (vLLM refuses only > 0 or -1 there); nothing is shown."""
    chunks = stream_chunks(served, {"model": model, "prompt": "abc def", "max_tokens": 2, "prompt_logprobs": 0})
    assert chunks and all("prompt_logprobs" not in c["choices"][0] for c in chunks if c["choices"])


def test_never_reads_the_prefix_cache(served, model, hf):
    """A prompt cached by a plain request: the prompt-logprobs request still computes
    (and scores) every position, and reports no cached tokens."""
    ids = hf[0](PROMPT * 2)["input_ids"]
    plain = {"model": model, "prompt": ids, "max_tokens": 1}
    post(served, "/v1/completions", plain)
    status, again = post(served, "/v1/completions", plain)
    assert status == 200 and again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    status, body = post(served, "/v1/completions", {**plain, "prompt_logprobs": 0})
    assert status == 200 and body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    want, _, _ = reference(hf, ids)
    got = [next(iter(e.values()))["logprob"] for e in body["choices"][0]["prompt_logprobs"][1:]]
    assert got == pytest.approx(want, abs=1e-4)


def test_chat_prompt_logprobs(served, model):
    status, body = post(served, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "hi there"}],
                                                         "max_tokens": 2, "prompt_logprobs": 1})
    assert status == 200
    plp = body["prompt_logprobs"]
    assert plp[0] is None and len(plp) == body["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in plp[1:])
