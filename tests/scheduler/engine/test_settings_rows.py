"""The settings table's rows whose choices are the scheduler's own implementations
(protocol/serve_flags/ may not import scheduler/): the same names on both sides."""

from __future__ import annotations

from protocol.serve_flags.cache import PREFIX_CACHING_HASH_ALGO
from protocol.serve_flags.kvpool import KV_EVICTION_POLICY
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from scheduler.core.vllm_hashing import DEFAULT_PREFIX_CACHING_HASH_ALGO, PREFIX_CACHING_HASH_ALGOS


def test_the_hash_choices_are_the_schedulers_hashes():
    assert PREFIX_CACHING_HASH_ALGO.kwargs["choices"] == PREFIX_CACHING_HASH_ALGOS
    assert PREFIX_CACHING_HASH_ALGO.default == DEFAULT_PREFIX_CACHING_HASH_ALGO


def test_the_eviction_choices_are_the_schedulers_policies():
    assert KV_EVICTION_POLICY.kwargs["choices"] == KV_EVICTION_POLICIES
