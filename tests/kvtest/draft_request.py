"""A request as the scheduler's drafters read it (scheduler/spec/suffix_proposer.py's
``Drafting``): its id, its tokens (the prompt first) and the drafter's state on it."""

from __future__ import annotations


class DraftRequest:
    def __init__(self, request_id: str, prompt: list[int]):
        self.request_id = request_id
        self.all_token_ids = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.draft_index = None
