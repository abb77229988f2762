"""Finishing on stop tokens: any of the model's EOS ids (unless ignore_eos), the
request's own stop_token_ids, never before min_tokens; the stop token is included.
And the row the worker gets carries the request's sampling parameters."""

from __future__ import annotations

import pytest

from protocol.sampling_params import SamplingParams
from protocol.worker_messages import RowSampling, StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler

BS = 4
EOS = (1, 9)  # a model with two EOS ids (config.json's and generation_config.json's)


def run(tokens: list[int], **kwargs) -> tuple[list[int], str]:
    """Feed ``tokens`` as the sampled outputs of one request; its outputs and finish reason."""
    sched = Scheduler(KVCacheManager(64, BS, 256), 8, 256, 256)
    sched.add_request(Request("r", [2, 3, 4, 5, 6], 20, seq_id=1, eos_token_id=EOS, block_hasher=BlockHasher(BS), **kwargs))
    for t in tokens:
        out = sched.schedule()
        res = sched.update_from_output(StepResult(out.plan.step_id, [1], [t]))
        if res.finish_reasons:
            return sched_outputs(res), res.finish_reasons[0]
    raise AssertionError("the request did not finish")


def sched_outputs(res) -> list[int]:
    return res.requests[0].output_token_ids


@pytest.mark.parametrize("eos", EOS)
def test_any_eos_id_stops(eos):
    assert run([7, 8, eos, 7]) == ([7, 8, eos], "stop")


def test_ignore_eos_goes_on_to_max_tokens():
    assert run([1, 9] * 10, ignore_eos=True) == ([1, 9] * 10, "length")


def test_stop_token_ids_stop_also_with_ignore_eos():
    assert run([7, 1, 42, 8], ignore_eos=True, stop_token_ids=[42]) == ([7, 1, 42], "stop")


def test_no_stop_before_min_tokens():
    # The worker masks stop ids until min_tokens are out; the scheduler's rule holds anyway.
    assert run([9, 7, 1, 42, 7], min_tokens=3, stop_token_ids=[42]) == ([9, 7, 1, 42], "stop")


def test_the_worker_row_carries_the_sampling_parameters():
    params = SamplingParams(temperature=0.7, seed=3)
    sched = Scheduler(KVCacheManager(64, BS, 256), 8, 256, 256)
    sched.add_request(Request("s", [2, 3, 4], 5, seq_id=4, sampling=params, block_hasher=BlockHasher(BS)))
    sched.add_request(Request("g", [2, 3], 5, seq_id=5, block_hasher=BlockHasher(BS)))
    rows = {r.seq_id: r for r in sched.schedule().plan.new_rows}
    assert rows[4].sampling == RowSampling(3, params) and rows[5].sampling is None
