"""End to end: vLLM's sampling parameters through the scheduler and the worker.

A seeded request draws the same tokens alone or in a crowd; stop_token_ids finish a
request with "stop" (the stop token included); min_tokens holds stop tokens back;
logprobs come back per token; an out-of-range parameter is a RequestError naming it.
"""

from __future__ import annotations

import math
import random

import msgspec
import pytest
from kvtest.cluster import Cluster
from kvtest.hf_models import reference_generate

from protocol.client_messages import Generate

pytestmark = pytest.mark.e2e

PROMPT = [random.Random(1).randrange(5, 512) for _ in range(24)]


def test_sampling_parameters_end_to_end(tmp_path, tiny_reference):
    greedy = reference_generate(tiny_reference, PROMPT, 24)
    rng = random.Random(2)
    seeded = Generate("s-alone", PROMPT, 24, ignore_eos=True, temperature=1.0, top_p=0.9, seed=7, presence_penalty=0.4)
    others = [Generate(f"o{i}", [rng.randrange(5, 512) for _ in range(8 + 5 * i)], 24, ignore_eos=True, temperature=0.8)
              for i in range(4)]
    stop = greedy[5]
    k = greedy.index(stop)
    with Cluster([], log_dir=tmp_path) as c:
        alone = c.generate([seeded])["s-alone"]
        crowd = c.generate([msgspec.structs.replace(seeded, request_id="s-crowd"), *others])
        plain = c.generate([Generate("g", PROMPT, 24, ignore_eos=True)])["g"]
        stopped = c.generate([Generate("st", PROMPT, 24, ignore_eos=True, stop_token_ids=[stop])])["st"]
        held = c.generate([Generate("mt", PROMPT, 24, ignore_eos=True, stop_token_ids=[stop], min_tokens=k + 3)])["mt"]
        lp = c.generate([Generate("lp", PROMPT, 4, ignore_eos=True, logprobs=5)])["lp"]
        bad = c.generate([Generate(f"bad-{f}", PROMPT, 8, **{f: v}) for f, v in BAD])
    assert alone.error is None and alone.token_ids == crowd["s-crowd"].token_ids
    assert alone.token_ids != greedy  # it really sampled
    assert plain.token_ids == greedy and plain.finish_reason == "length"
    assert stopped.token_ids == greedy[: k + 1] and stopped.finish_reason == "stop"
    assert stop not in held.token_ids[: k + 3] and len(held.token_ids) >= k + 3
    assert lp.token_ids == greedy[:4] and len(lp.logprobs) == 4
    for token, entry in zip(lp.token_ids, lp.logprobs, strict=True):
        assert entry.top_token_ids[0] == token and len(entry.top_token_ids) == 5
        assert math.isclose(entry.logprob, entry.top_logprobs[0]) and entry.logprob <= 0
    for f, _ in BAD:
        r = bad[f"bad-{f}"]
        assert r.error is not None and f in r.error, (f, r.error)


BAD = [("temperature", -1.0), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5), ("presence_penalty", 3.0),
       ("frequency_penalty", -2.5), ("repetition_penalty", 0.0), ("logprobs", 21), ("min_tokens", 9),
       ("stop_token_ids", [600])]
