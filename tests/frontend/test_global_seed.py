"""`kvpool serve --seed N` (vLLM's --seed): fresh servers given the same seed draw the
same unseeded temperature-1 text for the same request; another seed draws other text;
greedy text is the same whatever the seed. Three servers, started together."""

from __future__ import annotations

import contextlib

import pytest
from kvtest.http_api import PROMPT, post
from kvtest.serve import kvpool_serve

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def completion(served, **fields) -> str:
    status, body = post(served, "/v1/completions", {"prompt": PROMPT, "max_tokens": 24, "ignore_eos": True, **fields})
    assert status == 200, body
    assert body["usage"]["completion_tokens"] == 24
    return body["choices"][0]["text"]


def test_the_same_seed_repeats_unseeded_sampling_across_servers(tiny_checkpoint, tmp_path):
    with contextlib.ExitStack() as stack:
        servers = [stack.enter_context(kvpool_serve(tiny_checkpoint, tmp_path / f"s{i}", "--seed", str(seed)))
                   for i, seed in enumerate((7, 7, 8))]
        # each server's first sampled request: nothing drew from its generator before
        a, b, c = (completion(s, temperature=1.0) for s in servers)
        assert a == b
        assert a != c
        # a second request continues the same sequence on both seed-7 servers
        assert completion(servers[0], temperature=1.0) == completion(servers[1], temperature=1.0) != a
        greedy = [completion(s, temperature=0.0) for s in servers]
        assert greedy[0] == greedy[1] == greedy[2]
        # a request's own seed is its own: the same on every server whatever their seed
        own = [completion(s, temperature=1.0, seed=42) for s in servers]
        assert own[0] == own[1] == own[2]


def test_a_bad_seed_is_refused_before_anything_starts(tiny_checkpoint):
    import subprocess

    from kvtest.serve import KVPOOL

    r = subprocess.run([KVPOOL, "serve", str(tiny_checkpoint), "--seed", "-5"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "--seed: invalid seed '-5': expected an integer in 0..2**64-1" in r.stderr
