"""--speculative-config's suffix decoding: vLLM 0.32's fields and defaults, its refusals in
its words (``SpeculativeConfig._validate_suffix_decoding``), and fields it does not read refused by name."""

from __future__ import annotations

import json

import pytest

from protocol.speculative_config import SUFFIX, parse_speculative_config


def test_suffix_defaults_are_vllms():
    spec = parse_speculative_config('{"method": "suffix"}')
    assert spec.method == SUFFIX
    assert spec.suffix_decoding_max_tree_depth == 24
    assert spec.suffix_decoding_max_cached_requests == 10000
    assert spec.suffix_decoding_max_spec_factor == 1.0
    assert spec.suffix_decoding_min_token_prob == 0.1
    assert spec.num_speculative_tokens == 24  # vLLM: defaulted to the tree depth, a cap on variable drafts


def test_suffix_fields_are_read_and_round_trip():
    text = json.dumps({"method": "suffix", "num_speculative_tokens": 5, "suffix_decoding_max_tree_depth": 16,
                       "suffix_decoding_max_cached_requests": 0, "suffix_decoding_max_spec_factor": 2,
                       "suffix_decoding_min_token_prob": 0.5, "enforce_eager": True})
    spec = parse_speculative_config(text)
    assert (spec.num_speculative_tokens, spec.suffix_decoding_max_tree_depth, spec.suffix_decoding_max_cached_requests,
            spec.suffix_decoding_max_spec_factor, spec.suffix_decoding_min_token_prob) == (5, 16, 0, 2.0, 0.5)
    assert parse_speculative_config(spec.to_json()) == spec
    assert "prompt_lookup_min" not in json.loads(spec.to_json())
    # The tree depth given, num_speculative_tokens not: it follows the depth.
    assert parse_speculative_config('{"method": "suffix", "suffix_decoding_max_tree_depth": 7}').num_speculative_tokens == 7


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth=0 must be >= 1"),
        ({"suffix_decoding_max_cached_requests": -1}, "suffix_decoding_max_cached_requests=-1 must be >= 0"),
        ({"suffix_decoding_max_spec_factor": -0.5}, "suffix_decoding_max_spec_factor=-0.5 must be >= 0"),
        ({"suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob=1.5 must be in [0, 1]"),
        ({"suffix_decoding_min_token_prob": -0.1}, "suffix_decoding_min_token_prob=-0.1 must be in [0, 1]"),
        ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer greater than 0, got 0"),
        ({"suffix_decoding_max_tree_depth": "8"}, "suffix_decoding_max_tree_depth must be an integer, got '8'"),
        ({"suffix_decoding_max_spec_factor": True}, "suffix_decoding_max_spec_factor must be a number, got True"),
        ({"prompt_lookup_max": 3}, "field 'prompt_lookup_max' is not supported with suffix decoding"),
        ({"model": "suffix"}, "field 'model' is not supported with suffix decoding"),
    ],
)
def test_a_bad_suffix_config_is_refused_in_vllms_words(fields, words):
    with pytest.raises(ValueError) as e:
        parse_speculative_config({"method": "suffix", **fields})
    assert str(e.value) == words


def test_ngram_still_refuses_suffix_fields():
    with pytest.raises(ValueError, match="field 'suffix_decoding_max_tree_depth' is not supported with n-gram drafting"):
        parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "suffix_decoding_max_tree_depth": 8})
