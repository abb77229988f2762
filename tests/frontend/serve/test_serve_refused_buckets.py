"""kvpool serve with a --custom-histogram-buckets family the frontend's histograms draw
on: the scheduler refuses it at start-up, and kvpool serve quotes why, exit 1."""

from __future__ import annotations

import subprocess

from kvtest.serve import KVPOOL, free_port


def test_a_frontend_family_override_is_refused_by_name(tiny_checkpoint, tmp_path):
    argv = [KVPOOL, "serve", str(tiny_checkpoint), "--port", str(free_port()), "--log-dir", str(tmp_path), "--kv-cache-memory", "8MiB",
            "--device", "cpu", "--custom-histogram-buckets", '{"request_tokens": [1, 10]}']
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("kvpool serve: the scheduler exited during start-up (status 2): kvpool-scheduler: error: argument "
            "--custom-histogram-buckets: custom_histogram_buckets['request_tokens']: kvpool does not support overriding "
            "this family yet") in proc.stdout + proc.stderr, proc.stdout + proc.stderr
