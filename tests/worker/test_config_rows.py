"""WorkerConfig's defaults are the settings table's rows' (protocol/serve_flags/), not a
second copy."""

from __future__ import annotations

from protocol.serve_flags import WORKER, rows_for
from worker.config import WorkerConfig

# Settled when not given (None in the row), or kept in the worker's own terms: the model's
# name, the step's budget, the device found, the worker's nice, "" for no external tier.
SETTLED = {"served_model_name", "max_num_batched_tokens", "device", "cpu_nice", "kv_offloading_backend"}


def test_the_configs_defaults_are_the_rows():
    defaults = WorkerConfig()
    for row in rows_for(WORKER):
        if row.dest not in SETTLED and hasattr(defaults, row.dest):
            assert getattr(defaults, row.dest) == row.default, row.name
