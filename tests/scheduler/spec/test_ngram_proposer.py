"""The n-gram proposer answers as vLLM's NgramProposer: the reference below is vLLM 0.32's
``_find_longest_matched_ngram_and_propose_tokens`` (a KMP pass over the reversed tokens)
transcribed to plain Python, run on the same sequences as they grow token by token."""

from __future__ import annotations

import random

import pytest

from scheduler.spec.ngram_proposer import NgramProposer


def vllm_reference(tokens: list[int], min_n: int, max_n: int, max_model_len: int, k: int) -> list[int]:
    total = len(tokens)
    if total < min_n:
        return []
    k = min(k, max_model_len - total)
    if k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest, position, prev, i = 0, 0, 0, 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start : start + min(k, total - start)]


class Req:
    def __init__(self, tokens):
        self.all_token_ids = tokens
        self.draft_index = None


@pytest.mark.parametrize(("min_n", "max_n", "k", "vocab"), [(1, 1, 3, 3), (2, 4, 5, 4), (5, 5, 3, 2), (1, 6, 8, 6), (3, 3, 2, 20)])
def test_drafts_equal_vllms_as_a_sequence_grows(min_n, max_n, k, vocab):
    rng = random.Random(min_n * 100 + max_n * 10 + k)
    for _ in range(20):
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 10))]
        max_len = len(tokens) + 60
        proposer, req = NgramProposer(k, min_n, max_n, max_len), Req(tokens)
        for _ in range(60):
            assert proposer.propose(req) == vllm_reference(tokens, min_n, max_n, max_len, k), tokens
            # NOTE: several tokens at once too (accepted drafts): the index catches up on all of them.
            tokens.extend(rng.randrange(vocab) for _ in range(rng.choice((1, 1, 3))))
            if len(tokens) >= max_len:
                break


def test_the_earliest_occurrence_of_the_longest_suffix_and_the_caps():
    p = NgramProposer(3, 2, 3, 100)
    # suffix "1 2 3" occurs at 0 and 5; the earliest is followed by 7 8 9
    assert p.propose(Req([1, 2, 3, 7, 8, 1, 2, 3, 4, 9, 1, 2, 3])) == [7, 8, 1]
    # a 2-token suffix when no 3-token one repeats; nothing when neither does
    assert p.propose(Req([5, 1, 2, 6, 9, 1, 2])) == [6, 9, 1]
    assert p.propose(Req([5, 1, 2, 6, 9, 1, 3])) == []
    # never past the end of the sequence, nor past max_model_len
    assert p.propose(Req([1, 2, 1, 2])) == [1, 2]
    assert NgramProposer(3, 2, 3, 11).propose(Req([1, 2, 3, 4, 5, 6, 7, 1, 2])) == [3, 4]
    assert NgramProposer(3, 2, 3, 9).propose(Req([1, 2, 3, 4, 5, 6, 7, 1, 2])) == []


@pytest.mark.parametrize(("args", "words"), [((0, 1, 1, 9), "num_speculative_tokens"), ((2, 3, 2, 9), "prompt_lookup_min")])
def test_bad_settings_are_refused(args, words):
    with pytest.raises(ValueError, match=words):
        NgramProposer(*args)
