"""The scheduler's hybrid manager and a hybrid worker, in one process: after every step
the worker's per-group block tables equal the manager's (deltas, nulled entries and
prefix hits all arrive), and the greedy tokens equal those of the same layers served as
one full group (--disable-hybrid-kv-cache-manager), over prompts past the window with a
shared prefix and chunked prefill."""

from __future__ import annotations

import pytest
import torch

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import StepResult
from scheduler.core.hashing import BlockHasher
from scheduler.core.kv_cache_manager import KVCacheManager
from scheduler.sched.request import Request
from scheduler.sched.scheduler import Scheduler
from worker.kv.kv_cache import allocate_kv_caches, layer_kv_caches
from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.step.runner import ModelRunner

BS, W, NUM_BLOCKS, MAX_LEN = 4, 8, 64, 64
HYBRID = [KVCacheGroupSpec([0, 2], W), KVCacheGroupSpec([1, 3], 0)]
ONE_FULL = [KVCacheGroupSpec([0, 1, 2, 3], 0)]
PREFIX = [(5 * i + 9) % 500 + 2 for i in range(16)]
PROMPTS = [PREFIX + [(11 * i + j) % 500 + 2 for i in range(6 + 3 * j)] for j in range(4)]


@pytest.fixture(scope="module")
def model(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


def runner(model, groups) -> ModelRunner:
    c = model.config
    tensors = allocate_kv_caches(max(len(g.layer_ids) for g in groups), NUM_BLOCKS, BS, c.num_kv_heads, c.head_dim, torch.float32, "cpu")
    return ModelRunner(model, layer_kv_caches(tensors, groups), 4, MAX_LEN, groups=groups, layer_windows=[W, 0, W, 0])


def drive(runner: ModelRunner, kv, prompts: list[list[int]], max_tokens: int, preempted: list[int] | None = None) -> tuple[dict[str, list[int]], list[tuple[list, list]]]:
    """Every prompt through the scheduler (16-token steps: chunked prefill) and the
    runner: the greedy tokens by request, and after every step each running request's
    tables in the worker and in the manager. ``preempted`` gets the scheduler's preemptions."""
    sched = Scheduler(kv, 4, 16, MAX_LEN)
    hasher = BlockHasher(BS)
    outputs: dict[str, list[int]] = {}
    for j, prompt in enumerate(prompts):
        sched.add_request(Request(f"r{j}", prompt, max_tokens, seq_id=j, ignore_eos=True, block_hasher=hasher))
        outputs[f"r{j}"] = []
    tables = []
    for _ in range(200):
        out = sched.schedule()
        assert out is not None, "nothing to run with requests waiting"
        res = runner.execute(out.plan)
        step = sched.update_from_output(StepResult(out.plan.step_id, res.seq_ids, res.sampled_token_ids))
        for r, tok in zip(step.requests, step.token_ids, strict=True):
            outputs[r.request_id].append(tok)
        kv.check_invariants()
        for req in sched.running:
            ours = [t.block_ids(req.seq_id) for t in runner.groups.tables]
            theirs = list(kv.get_block_ids(req.request_id))
            tables.append((ours, theirs if theirs and isinstance(theirs[0], list) else [theirs]))
        if not sched.has_unfinished_requests():
            if preempted is not None:
                preempted.append(sched.num_preemptions)
            return outputs, tables
    raise AssertionError("the requests did not finish")


def test_hybrid_manager_and_worker_agree_and_equal_one_full_group(model):
    kv = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, group_windows=[W, 0])
    hybrid, tables = drive(runner(model, HYBRID), kv, PROMPTS, 6)
    assert tables and all(ours == theirs for ours, theirs in tables)
    assert any(0 in ours[0] for ours, _ in tables)  # the sliding group's entries were nulled
    assert kv.prefix_cache_stats.hits > 0  # the shared prefix was hit
    full, _ = drive(runner(model, ONE_FULL), KVCacheManager(NUM_BLOCKS, BS, MAX_LEN), PROMPTS, 6)
    assert hybrid == full and all(len(t) == 6 for t in full.values())


def gemma3_worker(d, num_blocks: int):
    """A worker built by its own start-up from the checkpoint at ``d`` (groups from
    config.json, shared tensors, hello), ready with ``num_blocks``; and its hello's windows."""
    from protocol.worker_messages import WorkerReady
    from worker.config import WorkerConfig
    from worker.load.serving_model import load_serving_model
    from worker.process import WorkerProcess
    from worker.startup import allocate_worker_kv_caches

    serving = load_serving_model(str(d), "float32", "cpu", MAX_LEN, block_size=BS)
    config = WorkerConfig(block_size=BS, kv_cache_memory=256 * 1024)
    proc = WorkerProcess(config, serving, allocate_worker_kv_caches(config, serving, None)[0], None)
    windows = proc.hello().group_windows
    assert proc._install(WorkerReady(num_blocks, BS, 4, MAX_LEN)) is None
    return proc, windows


def test_gemma3_preempted_by_a_small_hybrid_pool_equals_transformers(tmp_path):
    """Preemption by recompute under sliding windows: four requests grow past a 44-block
    pool (3 groups), one is preempted and recomputed, and every greedy token still equals
    transformers' float32 generate."""
    from kvtest import hf_models

    d = hf_models.make_checkpoint("gemma3", tmp_path / "g3")
    prompts = [[(7 * i + j) % 200 + 3 for i in range(28 + 4 * j)] for j in range(4)]
    ref = hf_models.load_reference(d)
    want = {f"r{j}": hf_models.reference_generate(ref, p, 20) for j, p in enumerate(prompts)}
    proc, windows = gemma3_worker(d, 44)
    kv = KVCacheManager(44, BS, MAX_LEN, group_windows=windows)
    preempted: list[int] = []
    got, tables = drive(proc.runner, kv, prompts, 20, preempted)
    assert preempted[0] >= 1, "the pool was meant to preempt"
    assert got == want and all(ours == theirs for ours, theirs in tables)


def test_gemma3_through_worker_startup_and_the_hybrid_manager_equals_transformers(tmp_path):
    """The worker's own start-up (groups from config.json, shared tensors, hello) with
    the hybrid manager its hello asks for: greedy tokens equal transformers' float32
    generate for prompts past the window of 16."""
    from kvtest import hf_models

    d = hf_models.make_checkpoint("gemma3", tmp_path / "g3")
    prompts = [[(7 * i + j) % 200 + 3 for i in range(40 + 5 * j)] for j in range(2)]
    ref = hf_models.load_reference(d)
    want = {f"r{j}": hf_models.reference_generate(ref, p, 4) for j, p in enumerate(prompts)}
    proc, windows = gemma3_worker(d, NUM_BLOCKS)
    assert windows == [16, 16, 0]  # layers [s, s, f] x 2: two sliding groups of 2 layers, one full
    kv = KVCacheManager(NUM_BLOCKS, BS, MAX_LEN, group_windows=windows)
    got, tables = drive(proc.runner, kv, prompts, 4)
    assert got == want and all(ours == theirs for ours, theirs in tables)
