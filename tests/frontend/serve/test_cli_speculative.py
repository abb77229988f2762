"""kvpool serve's --speculative-config and vLLM's shortcuts for it: what reaches the
scheduler's argv, and the refusals (vLLM's words where vLLM refuses), before anything starts."""

from __future__ import annotations

import json

import pytest

from frontend.serve import launcher
from frontend.serve.cli import main, parse_serve


@pytest.fixture
def fixed_ports(monkeypatch):
    monkeypatch.setattr(launcher, "free_ports", lambda n: list(range(20001, 20001 + n)))


def scheduler_spec(argv: list[str]) -> dict | None:
    la = launcher.Launcher(parse_serve(["serve", "m", *argv]), log=lambda *a, **k: None)
    la.build()
    sched = la.children["scheduler"].argv
    if "--speculative-config" not in sched:
        return None
    return json.loads(sched[sched.index("--speculative-config") + 1])


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        ([], None),
        (["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'],
         {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 5, "prompt_lookup_max": 5}),
        (["-sc", '{"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}'],
         {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 4}),
        (["--spec-method", "ngram", "--spec-tokens", "4"],
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, "prompt_lookup_max": 5}),
        (["--spec-tokens", "4", "--speculative-config", '{"method": "ngram", "prompt-lookup-min": 2}'],
         {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 2}),
        (["--speculative-config", "{}"], None),
        (["--spec-method", "suffix"],
         {"method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24,
          "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
          "suffix_decoding_min_token_prob": 0.1}),
        (["--spec-method", "suffix", "--spec-tokens", "3", "-sc", '{"suffix-decoding-min-token-prob": 0.2}'],
         {"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 24,
          "suffix_decoding_max_cached_requests": 10000, "suffix_decoding_max_spec_factor": 1.0,
          "suffix_decoding_min_token_prob": 0.2}),
    ],
)
def test_the_scheduler_gets_the_settled_config(fixed_ports, argv, expected):
    assert scheduler_spec(argv) == expected


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--spec-method", "ngram", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 2}'],
         "--spec-method and --speculative-config['method'] are mutually exclusive"),
        (["--spec-method", "ngram"], "num_speculative_tokens must be provided"),
        (["--spec-tokens", "3"], "num_speculative_tokens was provided but without speculative model"),
        (["-sc", '{"method": "ngram", "num_speculative_tokens": 0}'], "num_speculative_tokens must be an integer greater than 0"),
        (["-sc", '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2}'],
         "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
        (["-sc", '{"method": "eagle", "num_speculative_tokens": 2}'], "method 'eagle' is not supported"),
        (["-sc", '{"method": "ngram", "num_speculative_tokens": 2, "model": "draft"}'], "field 'model' is not supported"),
        (["-sc", "{nope"], "not valid JSON"),
        (["--spec-method", "suffix", "-sc", '{"suffix_decoding_max_spec_factor": -1}'],
         "suffix_decoding_max_spec_factor=-1.0 must be >= 0"),
    ],
)
def test_a_bad_config_is_refused_naming_the_problem(tiny_checkpoint, monkeypatch, capsys, argv, words):
    monkeypatch.setattr(launcher, "main_serve", lambda a: pytest.fail("a bad speculative config reached main_serve"))
    with pytest.raises(SystemExit) as e:
        main(["serve", str(tiny_checkpoint), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert words in err and ("--speculative-config" in err or "--spec-method" in err)
