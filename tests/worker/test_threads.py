"""The worker leaves a core to the scheduler unless OMP_NUM_THREADS is given."""

from __future__ import annotations

import pytest

from worker.threads import default_num_threads


@pytest.mark.parametrize(("env", "cpus", "expected"), [
    ({}, 2, 1), ({}, 16, 15), ({}, 1, 1), ({}, None, 1),
    ({"OMP_NUM_THREADS": "2"}, 2, None), ({"OMP_NUM_THREADS": ""}, 4, 3),
])  # fmt: skip
def test_one_core_fewer_than_the_machine_unless_told(env, cpus, expected):
    assert default_num_threads(env, cpus) == expected
