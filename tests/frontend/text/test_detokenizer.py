"""frontend.text.detokenizer: incremental text equals the one-shot decode (transformers'),
never half a UTF-8 character, and stop strings cut as vLLM cuts them."""

from __future__ import annotations

import random

import pytest
from kvtest.unicode_texts import TEXTS

from frontend.text.detokenizer import IncrementalDetokenizer, check_stop_strings
from frontend.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    return Tokenizer(tiny_checkpoint)


def stream(tok, ids, chunk=1, **kw):
    d = IncrementalDetokenizer(tok, **kw)
    pieces = []
    for i in range(0, len(ids), chunk):
        d.update(ids[i:i + chunk])
        pieces.append(d.get_next_output_text(finished=False, delta=True))
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


def test_random_ids_including_broken_utf8_give_the_one_shot_decode_less_an_unfinished_last_character(tok, hf_tokenizer):
    """As vLLM's DecodeStream text: every complete character of the one-shot decode, in
    order; an output that ends inside a character ends without it (no U+FFFD)."""
    rng = random.Random(0)
    for _ in range(30):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 40))]
        for skip in (True, False):
            _, pieces = stream(tok, ids, skip_special_tokens=skip)
            text, full = "".join(pieces), hf_tokenizer.decode(ids, skip_special_tokens=skip)
            assert full.startswith(text) and set(full[len(text):]) <= {"\ufffd"}


def test_a_metaspace_answer_keeps_its_leading_space(tiny_checkpoint, tmp_path):
    """vLLM seeds its DecodeStream with the prompt: the first output token is decoded as
    the prompt's continuation, so a SentencePiece-style answer keeps its leading space --
    the text is transformers' decode of prompt + output less the prompt's decode."""
    from kvtest.local_tokenizers import metaspace_checkpoint
    from transformers import AutoTokenizer

    d = metaspace_checkpoint(tiny_checkpoint, tmp_path / "metaspace")
    hf, tok = AutoTokenizer.from_pretrained(str(d)), Tokenizer(d)
    prompt = hf("the cat").input_ids
    for text in (" sat on the mat", " hello world", "s and 12 dogs", " 日本語"):
        out = hf(text, add_special_tokens=False).input_ids
        expected = hf.decode(prompt + out, skip_special_tokens=True)[len(hf.decode(prompt, skip_special_tokens=True)):]
        _, pieces = stream(tok, out, prompt_token_ids=prompt)
        assert "".join(pieces) == expected
    assert expected.startswith(" ") and not hf.decode(out, skip_special_tokens=True).startswith(" ")  # what an unseeded stream loses


@pytest.mark.parametrize(("skip", "spaces", "expected"), [
    (True, True, " hello worlds"),
    (True, False, " hello worlds"),  # skipped: nothing to join
    (False, True, " hello [A] [B] worlds [A]"),
    (False, False, " hello [A][B] worlds [A]"),  # only a special token after a special token loses its space
])
def test_spaces_between_special_tokens_as_vllm(tmp_path, skip, spaces, expected):
    """vLLM's FastIncrementalDetokenizer: with skip_special_tokens off and
    spaces_between_special_tokens off, an added token right after another is its bare
    content. WordPiece's decoder puts a space before each token (worked out by hand:
    hello, [A], [B], world, ##s, [A] after the prompt "hello")."""
    from kvtest.local_tokenizers import wordpiece_tokenizer

    tok = Tokenizer(wordpiece_tokenizer(tmp_path / "wp"))
    d = IncrementalDetokenizer(tok, skip_special_tokens=skip, prompt_token_ids=[1], spaces_between_special_tokens=spaces)
    d.update([1, 4, 5, 2, 3, 4])
    assert d.get_next_output_text(finished=True, delta=False) == expected


def test_a_stop_token_is_not_detokenized_unless_included(tok, hf_tokenizer):
    """vLLM's ``update(new_token_ids, stop_terminated)``: the token that ended the request
    (a stop_token_ids hit) adds no text, unless include_stop_str_in_output."""
    ids = hf_tokenizer("the cat sat", add_special_tokens=False).input_ids
    d = IncrementalDetokenizer(tok)
    d.update(ids, stop_terminated=True)
    assert d.output_text == hf_tokenizer.decode(ids[:-1]) and d.token_ids == ids
    d2 = IncrementalDetokenizer(tok, include_stop_str_in_output=True)
    d2.update(ids, stop_terminated=True)
    assert d2.output_text == hf_tokenizer.decode(ids)


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
        # vLLM 0.32: of several, the one that ends first wins, whatever the list's order
        ("hello world", 11, ["world", "lo"], False, ("lo", 3)),
        ("hello world", 11, ["world", "lo"], True, ("lo", 5)),
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
