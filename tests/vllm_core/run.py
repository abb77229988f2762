"""Run vLLM's tests of its KV-cache core (tests/v1/core: test_prefix_caching.py,
test_kv_cache_utils.py, test_single_type_kv_cache_manager.py) against kvpool's
classes through the shim (shim/vllm, a stand-in ``vllm`` package), in a pytest
process of their own, and print how many pass, fail and cannot run, and why.

    PYTHONPATH=$PWD .venv/bin/python tests/vllm_core/run.py [--upstream DIR] [--write-known]

vLLM's files are read from ``upstream/`` (not committed: copy them there from a vLLM
checkout, see README.md). ``--write-known`` rewrites known_passing.txt, the tests
that the suite (test_vllm_core.py) requires to keep passing.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
UPSTREAM = HERE / "upstream"
KNOWN_PASSING = HERE / "known_passing.txt"
FILES = ("test_prefix_caching.py", "test_kv_cache_utils.py", "test_single_type_kv_cache_manager.py")
OUTCOMES = ("passed", "failed", "not runnable")


def present(upstream: Path = UPSTREAM) -> list[Path]:
    return [upstream / name for name in FILES if (upstream / name).exists()]


def run(upstream: Path = UPSTREAM, timeout: float = 600) -> dict[str, tuple[str, str]]:
    """{test id: (outcome, reason)} of every test of vLLM's files found in ``upstream``."""
    files = present(upstream)
    if not files:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HERE / "shim"), str(REPO)]),
                   VLLM_CORE_REPORT=str(report))
        cmd = [sys.executable, "-m", "pytest", *map(str, files), "-p", "vllm_core_plugin", "-p", "no:randomly",
               "-p", "no:cacheprovider", "-q", "--no-header", "-c", str(HERE / "shim" / "pytest.ini"),
               "--rootdir", str(upstream), "--confcutdir", str(upstream)]
        subprocess.run(cmd, env=env, cwd=upstream, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       timeout=timeout, check=False)
        results = json.loads(report.read_text(encoding="utf-8"))
    return {test: (outcome, reason) for test, (outcome, reason) in results.items()}


def summary(results: dict[str, tuple[str, str]]) -> str:
    lines = []
    for name in FILES:
        mine = {t: r for t, r in results.items() if t.split("::")[0] == name}
        if not mine:
            continue
        counts = Counter(outcome for outcome, _ in mine.values())
        lines.append(f"{name}: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES))
    counts = Counter(outcome for outcome, _ in results.values())
    lines.append("all: " + ", ".join(f"{counts[o]} {o}" for o in OUTCOMES))
    for outcome in OUTCOMES[1:]:
        reasons = Counter(reason for o, reason in results.values() if o == outcome)
        if reasons:
            lines.append(f"\n{outcome}, by reason:")
            lines += [f"  {n:4d}  {reason}" for reason, n in reasons.most_common()]
    return "\n".join(lines)


def known_passing() -> list[str]:
    return [line for line in KNOWN_PASSING.read_text(encoding="utf-8").splitlines() if line and not line.startswith("#")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--upstream", type=Path, default=UPSTREAM, help="the folder holding vLLM's test files")
    parser.add_argument("--write-known", action="store_true", help="rewrite known_passing.txt from this run")
    args = parser.parse_args()
    results = run(args.upstream)
    if not results:
        sys.exit(f"none of {', '.join(FILES)} in {args.upstream}: copy them from vLLM's tests/v1/core (README.md)")
    print(summary(results))
    if args.write_known:
        passed = sorted(t for t, (outcome, _) in results.items() if outcome == "passed")
        KNOWN_PASSING.write_text("# vLLM's tests/v1/core tests that pass against kvpool through the shim (run.py --write-known)\n"
                                 + "".join(t + "\n" for t in passed), encoding="utf-8")


if __name__ == "__main__":
    main()
