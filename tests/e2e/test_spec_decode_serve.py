"""A live ``kvpool serve --speculative-config`` (n-gram or suffix drafts) against the same server without
it: greedy answers, their logprobs and a stop string's cut are the same, streamed answers join
to the same text, and /metrics counts the drafts as vLLM's vllm:spec_decode_* families. The
prompts repeat a passage (the tiny checkpoint's answers are what its random weights make of it;
the n-gram drafts come from the prompt and the answer so far, suffix drafts from those and from
the earlier answers to the same prompt)."""

from __future__ import annotations

import pytest
from kvtest.http_api import PROMPT, get_metrics, metric, post, post_stream
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SUFFIX = '{"method": "suffix", "num_speculative_tokens": 4}'
PROMPTS = [PROMPT * 2, "one two three four one two three four one two", PROMPT[:40] * 3, "a b a b a b a b"]


def answers(served) -> tuple[list, list, list]:
    plain, streamed, stopped = [], [], []
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": 0, "ignore_eos": True, "logprobs": 2}
        status, out = post(served, "/v1/completions", body)
        assert status == 200, out
        choice = out["choices"][0]
        plain.append((choice["text"], choice["logprobs"]["tokens"], choice["logprobs"]["token_logprobs"], out["usage"]["completion_tokens"]))
        events = post_stream(served, "/v1/completions", {**body, "stream": True, "logprobs": None})
        streamed.append("".join(e["choices"][0]["text"] for e in events if e["choices"]))
        # a stop string from the middle of the answer: the cut falls inside a step's tokens
        stop = choice["text"][len(choice["text"]) // 2 :][:3]
        if stop.strip():
            status, cut = post(served, "/v1/completions", {**body, "stop": [stop], "logprobs": None})
            assert status == 200, cut
            stopped.append((cut["choices"][0]["text"], cut["choices"][0]["finish_reason"]))
    return plain, streamed, stopped


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
def test_speculative_serve_answers_as_without_and_counts_its_drafts(tiny_checkpoint, tmp_path, spec):
    with kvpool_serve(tiny_checkpoint, tmp_path / "plain", "--dtype", "float32") as s:
        want = answers(s)
        assert "vllm:spec_decode_num_drafts" not in get_metrics(s)
    with kvpool_serve(tiny_checkpoint, tmp_path / "spec", "--dtype", "float32", "--speculative-config", spec) as s:
        got = answers(s)
        text = get_metrics(s)
    # NOTE: the logprobs of a verified token come from a forward over several positions at once,
    # not a one-token decode: the same up to float32 rounding.
    for (answer, tokens, logprobs, n), (want_text, want_tokens, want_logprobs, want_n) in zip(got[0], want[0], strict=True):
        assert (answer, tokens, n) == (want_text, want_tokens, want_n)
        assert logprobs == pytest.approx(want_logprobs, abs=1e-3)
    assert got[1:] == want[1:] and len(want[2]) >= 3
    assert all(n == 24 for *_, n in want[0])
    drafts, accepted = metric(text, "vllm:spec_decode_num_drafts_total"), metric(text, "vllm:spec_decode_num_accepted_tokens_total")
    assert drafts > 0 and 0 < accepted <= metric(text, "vllm:spec_decode_num_draft_tokens_total")
    assert metric(text, "vllm:spec_decode_num_accepted_tokens_per_pos_total") == accepted
    # every generated token counted once, drafts or not: at least the plain and the streamed answer of each prompt
    assert metric(text, "vllm:generation_tokens_total") >= len(PROMPTS) * 2 * 24

