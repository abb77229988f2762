"""The settings table's rows whose choices are the scheduler's own implementations
(protocol/serve_flags/ may not import scheduler/): the same names on both sides."""

from __future__ import annotations

from protocol.serve_flags import SCHEDULER, rows_for
from protocol.serve_flags.cache import PREFIX_CACHING_HASH_ALGO
from protocol.serve_flags.kvpool import KV_EVICTION_POLICY
from protocol.serve_flags.scheduling import SCHEDULING_POLICIES as SCHEDULING_POLICY_CHOICES
from protocol.serve_flags.scheduling import SCHEDULING_POLICY
from scheduler.core.retention.eviction_policies import KV_EVICTION_POLICIES
from scheduler.core.vllm_hashing import DEFAULT_PREFIX_CACHING_HASH_ALGO, PREFIX_CACHING_HASH_ALGOS
from scheduler.engine.args import DESTS
from scheduler.engine.config import SchedulerConfig
from scheduler.sched.policy_options import SCHEDULING_POLICIES


def test_the_hash_choices_are_the_schedulers_hashes():
    assert PREFIX_CACHING_HASH_ALGO.kwargs["choices"] == PREFIX_CACHING_HASH_ALGOS
    assert PREFIX_CACHING_HASH_ALGO.default == DEFAULT_PREFIX_CACHING_HASH_ALGO


def test_the_eviction_choices_are_the_schedulers_policies():
    assert KV_EVICTION_POLICY.kwargs["choices"] == KV_EVICTION_POLICIES


def test_the_scheduling_policy_choices_are_the_schedulers_policies():
    assert SCHEDULING_POLICY.kwargs["choices"] == SCHEDULING_POLICY_CHOICES == SCHEDULING_POLICIES


def test_the_configs_defaults_are_the_rows():
    # settled when not given (None in the row): the model's name and length, the step's budget
    settled = {"model_name", "max_model_len", "max_num_batched_tokens"}
    defaults = SchedulerConfig()
    for row in rows_for(SCHEDULER):
        name = DESTS.get(row.dest, row.dest)
        if name not in settled and hasattr(defaults, name):
            assert getattr(defaults, name) == row.default, row.name
