"""frontend/sampling/logits_fields.py and frontend/text/truncation.py against vLLM 0.32's rules,
worked by hand on a toy tokenizer: logit_bias keys and clamping, bad words tokenized
with and without a leading space (``SamplingParams.update_from_tokenizer``), ids that
no engine message can carry, and the prompt truncation of ``TokenizeParams``."""

from __future__ import annotations

import pytest

from frontend.sampling.logits_fields import bad_words_token_ids, logit_bias_of, with_logits_fields
from frontend.sampling.params import engine_params
from frontend.schema.errors import APIError
from frontend.schema.requests import CompletionRequest
from frontend.text.truncation import encode_truncated, tokens_kept, truncate_ids


class ToyTokenizer:
    """One token per character; a space and the next character are one token
    (" x" -> 100 + ord(x)); with special tokens a BOS (1) before and an EOS (2) after."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                ids.append(100 + ord(text[i + 1]))
                i += 2
            else:
                ids.append(ord(text[i]))
                i += 1
        return [1, *ids, 2] if add_special_tokens else ids


TOY = ToyTokenizer()


def refused(fn, *args) -> APIError:
    with pytest.raises(APIError) as info:
        fn(*args)
    assert info.value.status == 400
    return info.value


def test_logit_bias_keys_become_ids_and_values_are_clamped():
    assert logit_bias_of({"5": 1.5, "7": -250.0, "9": 300}) == {5: 1.5, 7: -100.0, 9: 100.0}
    assert logit_bias_of({}) is None and logit_bias_of(None) is None
    e = refused(logit_bias_of, {"5": 1.0, "a": 2.0, "b c": 3.0})
    assert (e.param, e.message) == ("logit_bias", "logit_bias contains key(s) that cannot be converted to integer token IDs: "
                                                  "['a', 'b c'] (parameter=logit_bias, value=['a', 'b c'])")


def test_bad_words_are_tokenized_as_vllm_does():
    # "ab": [97, 98]; " ab": [197, 98] -- a new first token, as many tokens: both banned
    assert bad_words_token_ids(TOY, ["ab"]) == [[97, 98], [197, 98]]
    # leading spaces are stripped before tokenizing; a word repeated verbatim counts once,
    # but vLLM drops repeats before stripping, so "  ab" and "ab" are two words
    assert bad_words_token_ids(TOY, ["ab", "ab"]) == [[97, 98], [197, 98]]
    assert bad_words_token_ids(TOY, ["  ab", "ab"]) == [[97, 98], [197, 98]] * 2
    # " a" is one token where "a" is one: both; a one-character word too
    assert bad_words_token_ids(TOY, ["a"]) == [[97], [197]]


def test_too_many_bad_words_are_refused():
    words = [chr(0x4E00 + i) for i in range(64)] + ["x"]  # 65 words, two sequences each
    e = refused(bad_words_token_ids, TOY, words)
    assert (e.param, e.message) == ("bad_words", f"Too many bad words after tokenization: 129. The max number is 128. "
                                                 f"(parameter=bad_words, value={words})")


def params_of(**fields):
    req = CompletionRequest(prompt="x", **fields)
    return req, engine_params(req, 8, None, {})


def test_the_generate_fields_carry_the_processors_once_each():
    req, p = params_of(logit_bias={"3": 2.0}, allowed_token_ids=[4, 5, 4], bad_words=["ab"], stop_token_ids=[9, 9, 8])
    g = with_logits_fields(p, req, TOY, 512).generate
    assert g["logit_bias"] == {3: 2.0} and g["allowed_token_ids"] == [4, 5] and g["stop_token_ids"] == [9, 8]
    assert g["bad_words_token_ids"] == [[97, 98], [197, 98]]
    req, p = params_of()
    assert with_logits_fields(p, req, TOY, 512).generate == p.generate  # nothing added to a plain request


def test_refusals_of_vllms_engine_wait_for_the_engine_requests():
    # an id no engine message carries: vLLM's words, given the vocabulary
    req, p = params_of(stop_token_ids=[3, 2**70])
    e = with_logits_fields(p, req, TOY, 512).refusal
    assert (e.status, e.param, e.message) == (400, "stop_token_ids", f"token_id(s) [{2**70}] in stop_token_ids contain out-of-vocab "
                                              f"token ids. Vocabulary size: 512 (parameter=stop_token_ids, value=[{2**70}])")
    req, p = params_of(allowed_token_ids=[-(2**64)])
    assert with_logits_fields(p, req, TOY, None).refusal.param == "allowed_token_ids"
    # the bad words' tokenization (vLLM's update_from_tokenizer, in its engine)
    req, p = params_of(bad_words=[chr(0x4E00 + i) for i in range(65)])
    assert with_logits_fields(p, req, TOY, 512).refusal.message.startswith("Too many bad words after tokenization: 129.")
    req, p = params_of(stop_token_ids=[2**40])
    assert with_logits_fields(p, req, TOY, 512).refusal is None

def test_ids_in_int64_go_on_for_the_scheduler_to_refuse():
    req, p = params_of(stop_token_ids=[2**40], allowed_token_ids=[])
    g = with_logits_fields(p, req, TOY, 512).generate
    assert g["stop_token_ids"] == [2**40] and g["allowed_token_ids"] == []


@pytest.mark.parametrize(("truncate", "max_output", "kept"), [
    (None, 16, None), (5, 16, 5), (0, 16, 0),
    (-1, 16, 99), (-1, None, 100), (-1, 0, 100),  # -1: the context less one output token, unless none is asked
])
def test_how_many_tokens_truncation_keeps(truncate, max_output, kept):
    assert tokens_kept(truncate, 100, max_output) == kept


def test_truncation_keeps_the_last_tokens_unless_told_right():
    assert truncate_ids([1, 2, 3, 4, 5], 3, None) == [3, 4, 5]
    assert truncate_ids([1, 2, 3, 4, 5], 3, "left") == [3, 4, 5]
    assert truncate_ids([1, 2, 3, 4, 5], 3, "right") == [1, 2, 3]
    assert truncate_ids([1, 2, 3], 5, None) == [1, 2, 3] and truncate_ids([1, 2], 0, None) == []


def test_a_text_prompt_keeps_its_special_tokens_unless_a_side_is_named():
    # "abcdef" -> [1, 97..102, 2]; the tokenizer's truncation keeps BOS and EOS
    assert encode_truncated(TOY, "abcdef", True, 5, None) == [1, 100, 101, 102, 2]
    # a named side slices the encoded ids whole, specials included (vLLM's _token_truncation)
    assert encode_truncated(TOY, "abcdef", True, 5, "left") == [99, 100, 101, 102, 2]
    assert encode_truncated(TOY, "abcdef", True, 3, "left") == [101, 102, 2]
    assert encode_truncated(TOY, "abcdef", True, 3, "right") == [1, 97, 98]
    assert encode_truncated(TOY, "abcdef", False, 2, None) == [101, 102]
    assert encode_truncated(TOY, "ab", True, 9, None) == [1, 97, 98, 2]
