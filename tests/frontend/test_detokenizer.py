"""frontend.detokenizer: incremental text equals the one-shot decode (transformers'),
never half a UTF-8 character, and stop strings cut as vLLM cuts them."""

from __future__ import annotations

import random

import pytest
from kvtest.unicode_texts import TEXTS

from frontend.detokenizer import IncrementalDetokenizer, check_stop_strings
from frontend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer(tiny_checkpoint)


def stream(tok, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        d.update(ids[i:i + chunk])
        pieces.append(d.get_next_output_text(finished=False, delta=True))
    d.finish()
    pieces.append(d.get_next_output_text(finished=True, delta=True))
    return d, pieces


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
def test_concatenated_pieces_equal_transformers_decode(tok, hf_tokenizer, text, chunk):
    ids = hf_tokenizer(text, add_special_tokens=False).input_ids + [1]
    _, pieces = stream(tok, ids, chunk)
    assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    for p in pieces:
        assert "\ufffd" not in p  # a complete character, never half of one


def test_random_ids_including_broken_utf8_still_concatenate_to_the_one_shot_decode(tok, hf_tokenizer):
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            _, pieces = stream(tok, ids, skip_special_tokens=skip)
            assert "".join(pieces) == hf_tokenizer.decode(ids, skip_special_tokens=skip)


def test_stop_string_cuts_the_text_and_holds_back_a_possible_start(tok, hf_tokenizer):
    ids = hf_tokenizer("the cat sat on the mat", add_special_tokens=False).input_ids
    d, pieces = stream(tok, ids, stop=["on the"])
    assert d.stop_reason == "on the"
    assert "".join(pieces) == d.output_text == "the cat sat "
    assert all("on" not in p for p in pieces)  # the stop string's start never went out
    d2, pieces2 = stream(tok, ids, stop=["on the"], include_stop_str_in_output=True)
    assert "".join(pieces2) == "the cat sat on the"


def test_tokens_after_a_stop_are_not_added(tok, hf_tokenizer):
    d = IncrementalDetokenizer(tok, stop=["b"])
    assert d.update(hf_tokenizer("a b c", add_special_tokens=False).input_ids) == "b"
    assert d.update(hf_tokenizer(" d", add_special_tokens=False).input_ids) == "b"
    assert d.output_text == "a "


@pytest.mark.parametrize(
    ("text", "new", "stop", "include", "expected"),
    [
        ("hello world", 5, ["wor"], False, ("wor", 6)),
        ("hello world", 2, ["wor"], False, None),  # "wor" ended before the new characters
        ("hello wor", 3, ["wor"], True, ("wor", -1)),  # ends the text: nothing to cut
        ("hello world", 3, ["wor"], True, ("wor", 9)),
        ("abc", 0, ["a"], False, None),
        ("abc", 1, [], False, None),
    ],
)
def test_check_stop_strings_as_vllm(text, new, stop, include, expected):
    assert check_stop_strings(text, new, stop, include) == expected


def test_stop_strings_wait_for_min_tokens_as_vllm(tok, hf_tokenizer):
    ids = hf_tokenizer("a b a b a b", add_special_tokens=False).input_ids
    early = IncrementalDetokenizer(tok, stop=["b"])
    assert early.update(ids) == "b" and early.output_text == "a "
    # Not looked for until more than min_tokens tokens came: the first "b"s pass.
    late = IncrementalDetokenizer(tok, stop=["b"], min_tokens=len(ids) - 1)
    assert late.update(ids) == "b"
    assert late.output_text == hf_tokenizer.decode(ids)[: hf_tokenizer.decode(ids).rindex("b")]
