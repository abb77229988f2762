"""A waiting request holds its prompt once (the waiting queue is most of the
scheduler's memory under a burst of long prompts)."""

from __future__ import annotations

import sys
import tracemalloc

from scheduler.sched.request import Request


def test_a_request_holds_its_prompt_once():
    n = 100_000
    one_list = sys.getsizeof(list(range(n)))
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        # As the engine hands it over: the decoded message's list, dropped after.
        prompt = [7] * n  # a cached small int: only the lists take memory
        request = Request("r", prompt, max_tokens=8)
        del prompt
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    retained = sum(s.size_diff for s in after.compare_to(before, "filename"))
    assert retained < 1.5 * one_list, f"{retained} bytes retained for a {one_list}-byte prompt list"
    assert request.prompt_token_ids == [7] * n and request.num_prompt_tokens == n
    request.append_output_token_id(5)
    assert request.prompt_token_ids == [7] * n and request.output_token_ids == [5]
