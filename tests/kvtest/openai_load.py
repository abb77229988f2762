"""The faults issue's load: `python -m loadgen --backend openai --request-rate 40
--num-requests N` against a live server, its summary written to ``result``."""

from __future__ import annotations

import subprocess
import sys


def openai_load(base_url: str, result, num_requests: int = 200) -> subprocess.Popen:
    """Start the load; the caller waits for it (bounded) and kills it on failure."""
    return subprocess.Popen(
        [sys.executable, "-m", "loadgen", "--backend", "openai", "--base-url", base_url, "--request-rate", "40",
         "--num-requests", str(num_requests), "--result-json", str(result)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )
