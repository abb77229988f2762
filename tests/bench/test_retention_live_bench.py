"""The retention_live bench's premise: the live requests it sends are the simulator's
own trace requests -- the same full blocks (so the same prefix-cache hashes) and the
same lengths -- for every slice it replays. (The bench itself, live against simulated,
runs outside the suite: `python -m bench retention_live`.)"""

from __future__ import annotations

import pytest

from bench.retention_live_bench import BS, SLICES, TRACES, VOCAB, prompts, records
from scheduler.core.hashing import BlockHasher
from simulator.workload import TraceWorkload

pytestmark = pytest.mark.skipif(not TRACES.is_dir(), reason="the Mooncake traces are not on this machine")


@pytest.mark.parametrize("trace, n, max_input_len", [s[:3] for s in SLICES])
def test_live_prompts_are_the_simulators(trace, n, max_input_len):
    recs = records(trace, n)
    assert all(r.output_length == 1 for r in recs)
    workload = TraceWorkload(recs, vocab_size=VOCAB, max_input_len=max_input_len)
    hasher = BlockHasher(BS, "xxhash")
    live = prompts(recs, max_input_len)
    assert len(live) == len(workload) == n
    for i, prompt in enumerate(live):
        sim_prompt, sim_hashes = workload.prompt(i, hasher)
        assert len(prompt) == len(sim_prompt) == min(recs[i].input_length, max_input_len)
        assert max(prompt) < VOCAB
        assert hasher.block_hashes(prompt) == sim_hashes
        tail = len(prompt) % BS
        assert prompt[len(prompt) - tail :] == sim_prompt[len(sim_prompt) - tail :]
