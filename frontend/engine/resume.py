"""What the engine client keeps of each request it started, so that a scheduler that
died and came back can be given them again (`EngineClient`'s recovery).

A request is kept from its Generate until its last output (or an error, or an abort):
its prompt, its parameters and the output tokens received so far. Given again, it
carries those outputs as ``resumed_token_ids``: the new scheduler recomputes them, as it
recomputes a preempted request's, and samples on from there, counting them against
``max_tokens`` and ``min_tokens``; the client's stream goes on where it stopped.

What a resumed request cannot keep: a seeded request's sampler restarts from its seed
(its tokens after the resume are a seeded draw, not the ones the lost scheduler would
have produced), and prompt logprobs, which came with the first output, are not asked
again. A request with no output yet is given again unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from protocol.client_messages import Generate


@dataclass(slots=True)
class Kept:
    prompt_token_ids: list[int]
    params: dict
    # Every output token received so far, in order.
    outputs: list[int] = field(default_factory=list)
    # Set when the client lost its scheduler: what the request waits from (the loss, or its
    # own start if later), for the bound on waiting for a scheduler to come back.
    waiting_since: float | None = None


class ResumeBook:
    """The requests in flight, by id."""

    __slots__ = ("kept",)

    def __init__(self):
        self.kept: dict[str, Kept] = {}

    def track(self, request_id: str, prompt_token_ids: list[int], params: dict) -> Kept:
        kept = self.kept[request_id] = Kept(prompt_token_ids, params)
        return kept

    def forget(self, request_id: str) -> None:
        self.kept.pop(request_id, None)

    def hold_all(self, since: float) -> None:
        """The scheduler was lost at ``since``: every request waits from then."""
        for kept in self.kept.values():
            kept.waiting_since = since

    def expired(self, now: float, limit: float) -> list[str]:
        """The requests that have waited longer than ``limit`` seconds for a scheduler."""
        return [rid for rid, k in self.kept.items() if k.waiting_since is not None and now - k.waiting_since > limit]

    def generate(self, request_id: str) -> Generate:
        """The Generate that resumes the request (the first one, while it has no output)."""
        k = self.kept[request_id]
        if not k.outputs:
            return Generate(request_id=request_id, prompt_token_ids=k.prompt_token_ids, **k.params)
        params = {**k.params, "prompt_logprobs": None}
        return Generate(request_id=request_id, prompt_token_ids=k.prompt_token_ids, resumed_token_ids=k.outputs, **params)
