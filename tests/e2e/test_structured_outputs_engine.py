"""Structured outputs through the engine alone (native client, real scheduler and
worker processes): requests with grammars in a pool small enough to preempt them give
the tokens they give in a roomy pool (a resumed row's matcher goes on where it was),
requests without one still equal transformers' greedy output, and a grammar the worker
cannot compile ends its request with an error while the engine goes on serving."""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster
from kvtest.hf_models import reference_generate

from protocol.client_messages import Generate
from protocol.structured_output import GrammarSpec

pytestmark = pytest.mark.e2e

PATTERN = "x[0-9]{3}y[a-z]{3}z[0-9]{4}"
# Long enough that rows with a grammar still run when the pool runs out.
GRAMMARS = [GrammarSpec("regex", "x[0-9]{3}y[a-z]{60}z"), GrammarSpec("ebnf", 'root ::= ("ab" | "cd" | "ef"){30,40} "."')]


def workload() -> list[Generate]:
    rng = random.Random(11)
    reqs = []
    for i in range(12):
        prompt = [rng.randrange(2, 512) for _ in range(rng.randrange(30, 50))]
        grammar = GRAMMARS[i % 2] if i % 3 else None
        reqs.append(Generate(f"r{i}", prompt, max_tokens=32, ignore_eos=grammar is None, structured_outputs=grammar))
    return reqs


def test_grammar_rows_survive_preemption_and_plain_rows_are_untouched(tmp_path, tiny_reference):
    reqs = workload()
    (tmp_path / "roomy").mkdir()
    (tmp_path / "small").mkdir()
    with Cluster([], ["--dtype", "float64"], log_dir=tmp_path / "roomy") as c:
        roomy = c.generate(reqs)
    # 24 blocks of 16 (23 usable) for 12 requests of up to 6 blocks each, admitted on their
    # first chunk (not their whole sequence): preemptions.
    small_pool = ["--num-gpu-blocks-override", "24", "--no-scheduler-reserve-full-isl"]
    with Cluster(small_pool, ["--dtype", "float64"], log_dir=tmp_path / "small") as c:
        small = c.generate(reqs)
        preemptions = c.metrics()["vllm:num_preemptions_total"]
    assert preemptions > 0
    for g in reqs:
        r = small[g.request_id]
        assert r.error is None and r.token_ids == roomy[g.request_id].token_ids, g.request_id
        if g.structured_outputs is None:
            assert r.token_ids == reference_generate(tiny_reference, g.prompt_token_ids, g.max_tokens, True)
        else:
            # EOS (1) only as the last token, once the grammar is complete
            assert 1 not in r.token_ids[:-1] and (r.finish_reason == "length" or r.token_ids[-1] == 1)


def test_a_grammar_the_worker_cannot_compile_ends_its_request(tmp_path):
    # NOTE: the frontend would have refused it (a 400); a native client can send it.
    bad = Generate("bad", [5, 6, 7], max_tokens=4, structured_outputs=GrammarSpec("ebnf", "root ::= ("))
    kind = Generate("kind", [5, 6, 7], max_tokens=4, structured_outputs=GrammarSpec("yaml", "a"))
    good = Generate("good", [5, 6, 7], max_tokens=30, structured_outputs=GrammarSpec("regex", PATTERN))
    with Cluster([], log_dir=tmp_path) as c:
        out = c.generate([bad, kind, good])
    assert out["bad"].error.startswith("grammar compilation failed: ")
    assert "structured_outputs kind must be one of" in out["kind"].error
    assert out["good"].error is None and out["good"].finish_reason == "stop"
