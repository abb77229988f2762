"""The small pool with every request queued before the first step, on both engines.

Served, the small-pool workload's preemptions depend on when each request reaches the
engine: the client opens 64 streams over some tens of milliseconds, the engines step at
different speeds, so each admits a different set before the pool fills (vLLM against
itself differs by that much from run to run). Queued at once, the schedule depends on
nothing but the policy, so the counters must be equal to the request:

* vLLM: ``bench/compare/vllm_offline.py`` in ``.venv-vllm`` — ``LLM.generate`` with the engine
  core in the same process, which adds every request before the scheduler's first step.
* kvpool: its Scheduler, KVCacheManager and BlockPool through the offline simulator
  (``simulator/engine.py``), every arrival at t = 0: the classes ``kvpool serve``'s
  scheduler runs, without a worker. The simulator's stand-in worker gives each request
  tokens of its own. With ignore_eos the schedule depends on token values only through
  block hashes, so this equals a real run unless two requests generated the same full
  block: ``shared_generated_blocks`` checks vLLM's outputs for that, and where it finds
  one the row is not judged.
"""

from __future__ import annotations

import json
import os
import subprocess
from dataclasses import asdict
from pathlib import Path

from bench.compare.servers import ServerConfig, stop_process_group
from bench.compare.workloads import shared_prefix_prompts
from loadgen.datasets import SampleRequest
from simulator.config import SimConfig
from simulator.replay import simulate
from simulator.workload import SampleWorkload

QUEUED = "small-pool queued"  # the table's name for this comparison
QUEUED_COUNTERS = ("vllm:num_preemptions", "vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def queued_prompts(num_prompts: int, vocab: int, seed: int = 3) -> list[list[int]]:
    """The small-pool workload's shape as token ids: 4 shared prefixes of 256 tokens,
    32-token suffixes."""
    return shared_prefix_prompts(num_prompts, vocab, 256, 32, seed)


def shared_generated_blocks(prompts: list[list[int]], outputs: list[list[int]], block_size: int) -> int:
    """Full blocks holding generated tokens whose whole token prefix two or more requests have."""
    seen: dict[tuple[int, ...], int] = {}
    for prompt, out in zip(prompts, outputs, strict=True):
        tokens = prompt + out
        for end in range((len(prompt) // block_size + 1) * block_size, len(tokens) + 1, block_size):
            key = tuple(tokens[:end])
            seen[key] = seen.get(key, 0) + 1
    return sum(1 for n in seen.values() if n > 1)


def run_vllm(root: Path, model: Path, cfg: ServerConfig, prompts: list[list[int]], max_tokens: int,
             env: dict[str, str], out: Path, timeout_s: float) -> dict:
    """vLLM's counters for the queued run, and its outputs (key "outputs")."""
    out.mkdir(parents=True, exist_ok=True)
    spec, result, log_path = out / "queued_spec.json", out / "queued_result.json", out / "queued.log"
    spec.write_text(json.dumps({"model": str(model), "config": asdict(cfg), "prompts": prompts, "max_tokens": max_tokens}))
    result.unlink(missing_ok=True)
    cmd = [str(root / ".venv-vllm/bin/python"), str(root / "bench/compare/vllm_offline.py"), str(spec), str(result)]
    with open(log_path, "wb") as log:
        # NOTE: a session of its own, so the whole group (compile workers included) is
        # killed on a timeout or Ctrl-C.
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True)
        try:
            rc = p.wait(timeout_s)
        finally:
            stop_process_group(p)
    if rc != 0 or not result.exists():
        raise RuntimeError(f"vLLM's queued run failed with {rc}; see {log_path}")
    doc = json.loads(result.read_text())
    return {c: doc["metrics"].get(c) for c in QUEUED_COUNTERS} | {"outputs": doc["outputs"]}


def run_kvpool(cfg: ServerConfig, prompts: list[list[int]], max_tokens: int, vocab: int) -> dict:
    """kvpool's scheduler on the same queue (see the module doc); counters as vLLM names them."""
    if not cfg.prefix_caching:
        raise ValueError("the queued comparison needs prefix caching on (the simulator always caches)")
    samples = [SampleRequest(p, max_tokens) for p in prompts]
    sim = SimConfig(num_blocks=cfg.num_blocks, block_size=cfg.block_size, max_num_seqs=cfg.max_num_seqs,
                    max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=cfg.max_model_len)
    r = simulate(SampleWorkload(samples, [0.0] * len(samples), vocab), sim)
    if r.num_finished != len(prompts):
        raise RuntimeError(f"kvpool's queued run finished {r.num_finished} of {len(prompts)} requests")
    return {"vllm:num_preemptions": r.num_preemptions, "vllm:prefix_cache_queries": r.prefix_cache_queries,
            "vllm:prefix_cache_hits": r.prefix_cache_hits}
