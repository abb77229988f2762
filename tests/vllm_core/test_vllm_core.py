"""vLLM's own tests of its KV-cache core, run against kvpool's classes through the shim
(run.py): every test known to pass (known_passing.txt) must still pass.

Skipped where vLLM's files are not in upstream/ (they are not committed; README.md).
"""

from __future__ import annotations

import pytest
from vllm_core.run import known_passing, present, run

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not present(), reason="no vLLM test files in tests/vllm_core/upstream (README.md)")
def test_the_vllm_core_tests_known_to_pass_still_pass():
    results = run()
    files = {path.name for path in present()}
    known = [test for test in known_passing() if test.split("::")[0] in files]
    regressed = {test: results.get(test, ("missing", "")) for test in known if results.get(test, ("",))[0] != "passed"}
    assert regressed == {}, f"vLLM core tests that passed and no longer do: {regressed}"
