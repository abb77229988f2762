"""Speculative decoding in the offline simulator: drafts accepted at a given rate.

The real Scheduler drafts with its ``proposer`` and verifies through
`Scheduler.update_from_output` (scheduler/spec/). The simulator gives it
`AcceptanceDrafter` in place of the n-gram proposer: every decoding request drafts K
tokens a step (fewer only where max_model_len leaves less room, as the n-gram proposer
caps them), of which the first m are right, m drawn as a truncated geometric: each draft
is accepted with probability A, the first rejection ends them (so P(m >= i) = A**i).

Why the draw is made when drafting, not when the step's result is built: the stand-in
worker (simulator/engine.py) then verifies as a real one does, sampling at every
position the request's own next token (request i's k-th output token is
``output_token_base[i] + k``, simulator/workload.py) and keeping the drafts while they
match. A row's tokens are therefore exactly those of a run without speculation; a right
draft is that token, a wrong one is `REJECTED_DRAFT`, below every output token id, so it
never matches. Drawing at verification instead would make a rejected position's token
something other than the request's own, and its cached blocks would differ from a run
without speculation. The acceptance count has the same law either way: where the step's
token budget keeps only a prefix of the drafts, the accepted ones are min(m, kept), a
geometric truncated at the kept count.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from simulator.workload import OUTPUT_TOKEN_BASE

# --spec-acceptance-rate's default.
DEFAULT_ACCEPTANCE_RATE = 0.7
# A wrong draft: below every output token id, so never the token sampled at its position.
REJECTED_DRAFT = OUTPUT_TOKEN_BASE - 1


class AcceptanceDrafter:
    """The scheduler's ``proposer`` in the simulator: K drafts for every decoding request,
    the first m right (see the module doc)."""

    __slots__ = ("k", "acceptance_rate", "max_model_len", "output_token_base", "rng")

    def __init__(self, k: int, acceptance_rate: float, max_model_len: int, output_token_base: Sequence[int], rng: random.Random):
        if k < 1:
            raise ValueError(f"num_speculative_tokens must be > 0, got {k}")
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance rate must be in [0, 1], got {acceptance_rate}")
        self.k = k
        self.acceptance_rate = acceptance_rate
        self.max_model_len = max_model_len
        self.output_token_base = output_token_base
        self.rng = rng

    def propose(self, request) -> list[int]:
        """K drafts to follow ``request``'s tokens (as NgramProposer, never past max_model_len)."""
        k = min(self.k, self.max_model_len - len(request.all_token_ids))
        if k <= 0:
            return []
        rate, draw = self.acceptance_rate, self.rng.random
        m = 0
        while m < k and draw() < rate:
            m += 1
        first = self.output_token_base[request.seq_id] + request.num_output_tokens
        return [*range(first, first + m), *[REJECTED_DRAFT] * (k - m)]

    def stop(self, request) -> None:
        """Keeps nothing across steps (scheduler/spec/proposer.py)."""

    def finish(self, request) -> None:
        """Keeps nothing across requests."""


def num_accepted(drafts: list[int], first_token: int) -> int:
    """How many of ``drafts`` the stand-in worker accepts: the leading ones equal to the
    tokens it samples there, ``first_token``, ``first_token + 1``, ... (the request's own)."""
    for m, draft in enumerate(drafts):
        if draft != first_token + m:
            return m
    return len(drafts)


def spec_figures(k: int, *stats) -> dict:
    """The result's spec-decode figures from the scheduler's SpecDecodingStats, summed over
    ``stats`` (a fleet's replicas), as vLLM's SpecDecodingLogging: draft acceptance rate =
    accepted / draft tokens, mean acceptance length = 1 + accepted / drafts, per position =
    accepted there / drafts. Empty without speculation."""
    stats = [s for s in stats if s is not None]
    if not stats:
        return {}
    drafts = sum(s.num_drafts for s in stats)
    draft_tokens = sum(s.num_draft_tokens for s in stats)
    accepted = sum(s.num_accepted_tokens for s in stats)
    per_pos = [sum(column) for column in zip(*(s.num_accepted_tokens_per_pos for s in stats), strict=True)]
    return {
        "num_speculative_tokens": k,
        "spec_num_drafts": drafts,
        "spec_num_draft_tokens": draft_tokens,
        "spec_num_accepted_tokens": accepted,
        "spec_draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "spec_mean_acceptance_length": 1.0 + accepted / drafts if drafts else 1.0,
        "spec_acceptance_rate_per_position": [n / drafts if drafts else 0.0 for n in per_pos],
    }
