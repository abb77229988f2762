"""kvpool's SuffixProposer drafts what Arctic Inference's ``SuffixDecodingCache`` drafts, driven
as vLLM 0.32's ``SuffixDecodingProposer`` drives it, token for token, on seeded random serving
runs (tests/scheduler/spec/make_suffix_drafts.py: steps of batches, requests left out of a step,
ended, their ids reused, global caches of 0 to 10000 responses).

The default suite checks the drafts Arctic 0.3.0 gave, saved as JSON; ``-m compare`` runs Arctic
itself on 200 other seeds, from .venv-vllm's python or $ARCTIC_PYTHON (skipped where neither has it).
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from kvtest.draft_request import DraftRequest

from scheduler.spec.suffix_proposer import SuffixProposer

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "data" / "arctic_suffix_drafts.json"




def replay(run: dict) -> list[list[list[int] | None]]:
    """Each step's drafts from kvpool's proposer, hooked as the scheduler hooks it (None: the request's last step)."""
    c = run["config"]
    proposer = SuffixProposer(c["num_speculative_tokens"], c["max_tree_depth"], c["max_cached_requests"],
                              c["max_spec_factor"], c["min_token_prob"], c["max_model_len"])
    running: dict[str, DraftRequest] = {}
    out = []
    for batch in run["steps"]:
        drafts = []
        for request_id, prompt, sampled, last in batch:
            if prompt is not None:
                running[request_id] = DraftRequest(request_id, prompt)
            request = running[request_id]
            request.all_token_ids += sampled
            if last:
                proposer.finish(request)
                del running[request_id]
                drafts.append(None)
            else:
                drafts.append(proposer.propose(request))
        in_batch = {entry[0] for entry in batch}
        for request_id, request in running.items():
            if request_id not in in_batch:
                proposer.stop(request)  # left out of the step, or preempted
        out.append(drafts)
    return out


def check_runs(runs: list[dict]) -> int:
    """Asserts every compared draft equal; returns how many were not empty."""
    num_drafted = 0
    for run in runs:
        for step, (theirs, ours) in enumerate(zip(run["drafts"], replay(run), strict=True)):
            for expected, got in zip(theirs, ours, strict=True):
                if got is None:
                    continue
                assert got == expected, (run["seed"], step, run["config"])
                num_drafted += bool(expected)
    return num_drafted


def test_drafts_equal_arctics_saved_drafts():
    data = json.loads(FIXTURE.read_text())
    assert data["arctic_inference"] == "0.3.0"
    num_drafted = check_runs(data["runs"])
    assert num_drafted > 1000  # NOTE: the runs must draft often for equality to mean anything


@pytest.mark.compare
def test_drafts_equal_arctics_on_fresh_seeds(real_vllm):
    # NOTE: vLLM's suffix decoding imports Arctic in .venv-vllm, so it is looked for there (as the
    # other compare tests find vLLM), or in the python $ARCTIC_PYTHON names.
    python = os.environ.get("ARCTIC_PYTHON") or str(real_vllm / ".venv-vllm/bin/python")
    probe = subprocess.run([python, "-c", "import arctic_inference.suffix_decoding"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"no arctic_inference in {python} (pip install arctic-inference==0.3.0, or set ARCTIC_PYTHON)")
    done = subprocess.run([python, str(HERE / "make_suffix_drafts.py"), "1000", "200"], capture_output=True, text=True,
                          check=True, cwd=real_vllm)
    runs = json.loads(done.stdout)["runs"]
    assert check_runs(runs) > 5000
