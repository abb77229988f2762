"""SuffixProposer on small cases worked by hand: a request's own prompt, other requests'
responses, the min_token_prob and max_spec_factor cuts, FIFO eviction of cached responses.

Counting rule used below: a path's count is how many times it occurs in the tree's sequences;
a draft follows the most frequent child (the first-inserted on a tie), each token's probability
is the product of child count / parent count along the way, and the draft with the highest sum
of probabilities wins (the longer match on a tie).
"""

from __future__ import annotations

import pytest
from kvtest.draft_request import DraftRequest

from scheduler.spec.suffix_proposer import SuffixProposer
from scheduler.spec.suffix_tree import SuffixTree


def proposer(k=5, depth=8, cached=0, factor=1.0, min_prob=0.1, max_model_len=100) -> SuffixProposer:
    return SuffixProposer(k, depth, cached, factor, min_prob, max_model_len)


def sample(p: SuffixProposer, request: DraftRequest, *tokens: int) -> list[int]:
    request.all_token_ids += tokens
    return p.propose(request)


@pytest.mark.parametrize(("factor", "expected"), [(4.0, [4, 5, 6, 1, 2]), (1.0, [4, 5, 6]), (0.5, [4])])
def test_a_prompt_match_drafts_what_followed_it_at_most_factor_times_the_match(factor, expected):
    # tokens 1 2 3 4 5 6 1 2 | 3. "3" twice, once followed by 4: p = 1/2 for every token after.
    # Matches: "3" (m=1), "23" (2), "123" (3) all continue 4 5 6 1 2 ...; "6123" (4) occurs once: nothing.
    # factor 4: m=1 drafts 4 tokens (score 2), m=2 and m=3 five (k; 2.5 each) -> 4 5 6 1 2.
    # factor 1: m tokens for a match of m: best m=3, 4 5 6 (1.5). factor 0.5: int(0.5 m): m=2,3 -> one token.
    p = proposer(factor=factor)
    assert sample(p, DraftRequest("a", [1, 2, 3, 4, 5, 6, 1, 2]), 3) == expected


def test_the_tree_depth_bounds_match_plus_draft():
    # depth 4: no path past 4 tokens. "3" (m=1) goes 3 deeper: 4 5 6 (1.5); "23" 4 5 (1.0); "123" 4 (0.5).
    p = proposer(depth=4, factor=4.0)
    assert sample(p, DraftRequest("a", [1, 2, 3, 4, 5, 6, 1, 2]), 3) == [4, 5, 6]


@pytest.mark.parametrize(("min_prob", "expected"), [(0.3, []), (0.25, [1])])
def test_min_token_prob_cuts_a_rare_continuation(min_prob, expected):
    # tokens 5 1 5 2 5 3 | 5: "5" four times, followed by 1, 2, 3 once each: the first-inserted, 1,
    # at p = 1/4. "35" once, nothing after it.
    p = proposer(min_prob=min_prob)
    assert sample(p, DraftRequest("a", [5, 1, 5, 2, 5, 3]), 5) == expected


def test_a_later_request_drafts_from_an_earlier_ones_response():
    # A's response 1 2 3 4 5 is cached; B (8 1 2 | 3) has nothing after "3" of its own. Global tree:
    # A's 1 2 3 4 5 and B's 3: "3" twice (p 1/2 for 4), "23" and "123" once each, then 4 5 (p 1).
    # m=2: 4 5 (score 2); m=3: 4 5 too (A ends there), the longer match on the tie.
    p = proposer(cached=10)
    a = DraftRequest("a", [9, 9])
    sample(p, a, 1)
    a.all_token_ids += [2, 3, 4, 5]
    p.finish(a)  # the tokens of its last steps go in as it ends
    assert sample(p, DraftRequest("b", [8, 1, 2]), 3) == [4, 5]
    # No global tree: B's own prompt has nothing after "3".
    p = proposer(cached=0)
    a = DraftRequest("a", [9, 9])
    sample(p, a, 1, 2, 3, 4, 5)
    p.finish(a)
    assert sample(p, DraftRequest("b", [8, 1, 2]), 3) == []


def test_running_requests_draft_from_each_others_tokens_so_far():
    p = proposer(cached=10)
    a, b = DraftRequest("a", [9]), DraftRequest("b", [8, 1, 2])
    sample(p, a, 1, 2, 3, 4)  # A runs on: its response so far is in the global tree already
    assert sample(p, b, 3) == [4]  # "123" then 4, where A stopped so far (p 1: score 1 beats "3"'s 1/2)


@pytest.mark.parametrize(("first", "kept"), [("a", False), ("c", True)])
def test_the_global_tree_evicts_the_oldest_started_response(first, kept):
    # Two cached responses at most. A (… 1 2 3 4 5) and C (7 7) start in the order given, then B
    # starts: the first started goes. B drafts 4 5 from A's response only while it is kept.
    p = proposer(cached=2)
    reqs = {"a": DraftRequest("a", [9, 9]), "c": DraftRequest("c", [6])}
    tokens = {"a": [1, 2, 3, 4, 5], "c": [7, 7]}
    for rid in (first, "c" if first == "a" else "a"):
        sample(p, reqs[rid], *tokens[rid])
        p.finish(reqs[rid])
    assert sample(p, DraftRequest("b", [8, 1, 2]), 3) == ([4, 5] if kept else [])
    assert list(p.cached) == (["a", "b"] if first == "c" else ["c", "b"])


def test_a_request_back_after_a_stop_starts_again_from_its_prompt():
    # As vLLM's runner: a request out of the batch (preempted) stops; back, it starts afresh with its
    # prompt and the tokens from then on, and its own cached response is replaced.
    p = proposer(cached=10)
    a = DraftRequest("a", [4, 4])
    assert sample(p, a, 1, 2, 3, 1) == [2]  # "1" twice, then 2 at 1/2, one token for a match of one; "31": once
    p.stop(a)
    assert sample(p, a, 2) == []  # its tree: 4 4 | 2; its cached response: just 2
    assert list(p.cached) == ["a"] and p.global_tree.seqs[p.cached["a"]] == [2]


def test_drafts_stop_short_of_max_model_len():
    p = proposer(factor=4.0, max_model_len=11)
    request = DraftRequest("a", [1, 2, 3, 4, 5, 6, 1, 2])
    assert sample(p, request, 3) == [4]  # 9 tokens: at most 11 - 9 - 1 drafts
    assert sample(p, request, 4, 5) == []  # at max_model_len: no draft, nothing fed


def test_the_tree_counts_occurrences_and_drops_a_removed_sequence():
    tree = SuffixTree(3)
    tree.extend(0, [1, 2, 1, 2])
    tree.extend(1, [2, 1])
    node, idx = tree.match([1, 2], 0)
    assert node.count == 2 and idx == node.length  # "12": twice in sequence 0
    node, _ = tree.match([2, 1], 0)
    assert node.count == 2  # once in each
    tree.remove(0)
    node, _ = tree.match([2, 1], 0)
    assert node.count == 1 and tree.match([1, 2], 0) == (None, -1)
    assert tree.root.count == 2
