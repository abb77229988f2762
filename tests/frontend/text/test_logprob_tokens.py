"""How a logprob shows a token that is a piece of a UTF-8 sequence (byte fallback), as
vLLM's LogprobsProcessor does: "" while the sequence is unfinished, the character once
a preceding piece of the context completes it. The tiny checkpoint's byte-level
tokens: 131 and 99 are the bytes C2 and A1 of "¡" (checked through the tokenizer)."""

from __future__ import annotations

import pytest

from frontend.text.logprob_tokens import decoded_tokens
from frontend.text.tokenizer import Tokenizer

LEAD, CONT, WORD = 131, 99, 262


@pytest.fixture(scope="module")
def tok(tiny_checkpoint):
    t = Tokenizer(tiny_checkpoint)
    assert t.token_text(LEAD).endswith("\ufffd") and t.token_text(CONT).endswith("\ufffd")
    assert t.decode([LEAD, CONT], skip_special_tokens=False) == "¡"
    assert not t.token_text(WORD).endswith("\ufffd")
    return t


def test_an_unfinished_piece_shows_nothing(tok):
    assert decoded_tokens(tok, [CONT], []) == [""]
    assert decoded_tokens(tok, [LEAD], [WORD]) == [""]


def test_the_piece_that_finishes_a_character_shows_it(tok):
    # The lead byte showed "" when it came: the whole character is the continuation's.
    assert decoded_tokens(tok, [CONT], [LEAD]) == ["¡"]
    assert decoded_tokens(tok, [CONT], [WORD, WORD, LEAD]) == ["¡"]
    # Alternatives at one position are corrected each on its own; whole tokens unchanged.
    assert decoded_tokens(tok, [WORD, CONT], [LEAD]) == [tok.token_text(WORD), "¡"]
