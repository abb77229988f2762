"""End to end, real scheduler and CPU worker processes: the disk tier
(--kv-offloading-backend disk on both), its warm restart, and its faults.

The workload of tests/e2e/test_offload.py: four 4-block prefixes, each asked in turn three
times, one request at a time, with a pool of 11 usable blocks (about two requests' worth),
so without a tier every revisit computes its prefix again. With the disk tier:

* every revisit loads its prefix from the directory, and the greedy tokens are the ones
  computed without a tier (and transformers' reference);
* a new scheduler and worker on the same directory (a restart) find every prefix on
  their first requests;
* a directory whose every object was corrupted, or whose files hold another identity,
  serves nothing wrong: each bad block is refused, recomputed, saved again;
* a disk that fills up stops saving, with a metric and a log line, and serving goes on.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess

import pytest
from kvtest.cluster import Cluster, free_port
from kvtest.hf_models import reference_generate
from prometheus_client.parser import text_string_to_metric_families

from bench.kv_block_bytes import kv_bytes_per_block
from protocol.client_messages import Generate
from protocol.external_kv import HEADER_SIZE

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 16
NUM_PREFIXES, PREFIX_BLOCKS, ROUNDS = 4, 4, 3
DEVICE = ["--num-gpu-blocks-override", "12", "--max-num-seqs", "1"]
DISK = ["--kv-offloading-backend", "disk"]


def workload(rounds: int = ROUNDS) -> list[Generate]:
    rng = random.Random(11)
    prefixes = [[rng.randrange(2, 512) for _ in range(PREFIX_BLOCKS * BLOCK)] for _ in range(NUM_PREFIXES)]
    tails = [[rng.randrange(2, 512) for _ in range(3)] for _ in range(ROUNDS * NUM_PREFIXES)]
    return [
        Generate(f"r{r}-p{p}", prefixes[p] + tails[r * NUM_PREFIXES + p], max_tokens=6, ignore_eos=True)
        for r in range(rounds) for p in range(NUM_PREFIXES)
    ]


def run(log_dir, disk_dir, requests: list[Generate], disk_gib: str = "0.01", host_gib: str | None = None):
    """Every request in turn, on a scheduler and worker with the disk tier at ``disk_dir``
    (and a host tier of ``host_gib``): the results, the scheduler's metrics, the worker's
    samples and its log."""
    log_dir.mkdir()
    worker_http = free_port()
    tier = [*DISK, "--kv-offloading-path", str(disk_dir), "--kv-offloading-disk-size", disk_gib] if disk_dir else []
    host = ["--kv-offloading-size", host_gib] if host_gib else []
    with Cluster([*DEVICE, *(DISK if disk_dir else []), *host], ["--dtype", "float32", *tier, *host, "--http-port", str(worker_http)],
                 log_dir=log_dir) as c:
        results = {}
        for g in requests:
            r = c.generate([g], timeout=60)[g.request_id]
            assert r.error is None and r.finish_reason == "length", r
            results[g.request_id] = r
        m = c.metrics()
        for f in text_string_to_metric_families(c.metrics_text()):
            for smp in f.samples:
                if "source" in smp.labels:
                    m[f"{smp.name}{{source={smp.labels['source']}}}"] = smp.value
        worker = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for f in text_string_to_metric_families(c.metrics_text(worker_http)) for s in f.samples
        }
    return results, m, worker, (log_dir / "worker.log").read_text()


def tokens(results) -> dict[str, list[int]]:
    return {rid: r.token_ids for rid, r in results.items()}


def sample(worker: dict, name: str, **labels) -> float:
    """The sum of the samples of ``name`` whose labels include ``labels``."""
    want = set(labels.items())
    return sum(v for (n, ls), v in worker.items() if n == name and want <= set(ls))


@pytest.fixture(scope="module")
def no_tier(tmp_path_factory):
    return run(tmp_path_factory.mktemp("disk") / "no-tier", None, workload())


@pytest.fixture(scope="module")
def reference(tiny_reference):
    return {g.request_id: reference_generate(tiny_reference, g.prompt_token_ids, g.max_tokens, True) for g in workload()[NUM_PREFIXES:]}


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """The workload on an empty directory; the directory is kept for the restart."""
    root = tmp_path_factory.mktemp("disk-tier")
    disk = root / "kv"
    return disk, run(root / "first", disk, workload())


def test_revisits_load_their_prefix_from_disk_with_the_same_outputs(first_run, no_tier, reference, tiny_checkpoint):
    disk, (results, m, worker, _) = first_run
    base, base_m = tokens(no_tier[0]), no_tier[1]
    assert tokens(results) == base
    for request_id, expected in reference.items():
        assert results[request_id].token_ids == expected, request_id
    # Without a tier no revisit hits; with the disk tier every revisit finds its whole prefix.
    assert base_m["vllm:prefix_cache_hits_total"] == 0
    hits = m["vllm:prefix_cache_hits_total"] + m["vllm:external_prefix_cache_hits_total"]
    assert hits == (ROUNDS - 1) * NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    for r in range(1, ROUNDS):
        for p in range(NUM_PREFIXES):
            assert results[f"r{r}-p{p}"].num_cached_tokens == PREFIX_BLOCKS * BLOCK
    # The worker loaded exactly those blocks, and saved each block once, as files of the block's bytes.
    per_block = kv_bytes_per_block(tiny_checkpoint, BLOCK, "float32")
    loaded = m["vllm:external_prefix_cache_hits_total"] // BLOCK
    assert sample(worker, "vllm:kv_offload_tiering_read_bytes_total", tier="1:disk") == loaded * per_block
    files = list(disk.rglob("*.kv"))
    # Full blocks: the prefixes' only (a request's 5th block holds 3 tail and 6 output tokens of 16).
    assert len(files) == NUM_PREFIXES * PREFIX_BLOCKS
    assert {f.stat().st_size for f in files} == {HEADER_SIZE + per_block}
    assert sample(worker, "vllm:kv_offload_tiering_write_bytes_total", tier="1:disk") == len(files) * per_block
    # The scheduler counts them under vLLM's source label, and its own block counters agree with the worker's.
    assert m["vllm:prompt_tokens_cached_by_source_total{source=disk}"] == loaded * BLOCK
    assert m["vllm:prompt_tokens_cached_by_source_total{source=host}"] == 0
    assert m["kvpool_kv_offload_external_loaded_blocks_total"] == loaded
    assert m["kvpool_kv_offload_external_saved_blocks_total"] == len(files)
    assert m["kvpool_kv_offload_external_load_failed_blocks_total"] == 0
    # Idle afterwards: no device block held.
    assert m["vllm:kv_cache_usage_perc"] == 0.0 and m["kvpool_free_blocks"] == 11


def test_below_a_host_tier_the_disk_serves_what_host_memory_evicted(no_tier, tmp_path):
    # A host tier of 8 slots (32 KiB blocks): half the prefixes' blocks; the rest come from disk.
    results, m, _, _ = run(tmp_path / "both", tmp_path / "kv", workload(), host_gib="0.00025")
    assert tokens(results) == tokens(no_tier[0])
    host, disk = m["vllm:prompt_tokens_cached_by_source_total{source=host}"], m["vllm:prompt_tokens_cached_by_source_total{source=disk}"]
    assert host > 0 and disk > 0
    assert m["vllm:prefix_cache_hits_total"] + host + disk == (ROUNDS - 1) * NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    assert m["kvpool_kv_offload_external_loaded_blocks_total"] * BLOCK == disk


def test_a_restart_on_the_same_directory_finds_every_prefix(first_run, no_tier, tmp_path):
    disk, _ = first_run
    # The first round again (a new tail each, the same prefixes), on new processes.
    requests = [Generate(f"again-{g.request_id}", g.prompt_token_ids, max_tokens=6, ignore_eos=True) for g in workload(1)]
    results, m, _, _ = run(tmp_path / "restart", disk, requests)
    for g in requests:
        assert results[g.request_id].num_cached_tokens == PREFIX_BLOCKS * BLOCK, g.request_id
        assert results[g.request_id].token_ids == no_tier[0][g.request_id.removeprefix("again-")].token_ids
    assert m["vllm:prefix_cache_hits_total"] == 0
    assert m["vllm:external_prefix_cache_hits_total"] == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK


def corrupt(disk, how: str) -> int:
    """Spoil every object: flip a payload byte, cut it short, or give it another identity."""
    files = sorted(disk.rglob("*.kv"))
    for f in files:
        data = bytearray(f.read_bytes())
        if how == "flip":
            data[HEADER_SIZE + 100] ^= 0xFF
        elif how == "truncate":
            data = data[: len(data) // 2]
        else:  # another identity in the header (bytes 8..24), as a copied file of another model would
            data[8:24] = bytes(16)
        f.write_bytes(bytes(data))
    return len(files)


@pytest.mark.parametrize("how", ["flip", "truncate", "foreign"])
def test_a_bad_object_is_a_miss_never_served(first_run, no_tier, tmp_path, how):
    src, _ = first_run
    disk = tmp_path / "kv"
    shutil.copytree(src, disk)
    assert corrupt(disk, how) > 0
    requests = workload(1)
    results, m, worker, log = run(tmp_path / "run", disk, requests)
    # The lookups hit (the listing holds every key), the loads fail the check, the blocks are computed again.
    assert tokens(results) == {g.request_id: no_tier[0][g.request_id].token_ids for g in requests}
    reason = {"flip": "checksum", "truncate": "truncated", "foreign": "foreign"}[how]
    assert sample(worker, "kvpool_kv_offload_tiering_bad_blocks_total", tier="1:disk", reason=reason) == NUM_PREFIXES
    assert sample(worker, "vllm:kv_offload_tiering_read_bytes_total", tier="1:disk") == 0
    assert "refused" in log
    # No request counts a cached token it did not get (vLLM's hit counters count what the lookup claimed).
    assert all(r.num_cached_tokens == 0 for r in results.values())
    assert m["vllm:external_prefix_cache_hits_total"] == NUM_PREFIXES * PREFIX_BLOCKS * BLOCK
    # Each bad object was removed and its block saved again, whole: a second pass loads them.
    again = [Generate(f"again-{g.request_id}", g.prompt_token_ids, max_tokens=6, ignore_eos=True) for g in requests]
    results2, _, worker2, _ = run(tmp_path / "again", disk, again)
    assert all(r.num_cached_tokens == PREFIX_BLOCKS * BLOCK for r in results2.values())
    assert sample(worker2, "kvpool_kv_offload_tiering_bad_blocks_total") == 0


@pytest.fixture
def small_fs(tmp_path):
    """A real filesystem of 256 KiB (tmpfs), unmounted afterwards."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(mnt)], check=True, capture_output=True, timeout=10)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True, timeout=10)


def test_a_full_disk_stops_saving_and_serving_goes_on(small_fs, no_tier, tmp_path):
    # The bound (1 GiB) is far above what the filesystem holds: the writes themselves fail (ENOSPC).
    requests = workload(2)
    results, m, worker, log = run(tmp_path / "run", small_fs / "kv", requests, disk_gib="1")
    assert tokens(results) == {g.request_id: no_tier[0][g.request_id].token_ids for g in requests}
    assert sample(worker, "kvpool_kv_offload_tiering_save_failures_total", tier="1:disk", reason="full") >= 1
    assert "saving pauses" in log and "No space left on device" in log
    assert os.statvfs(small_fs).f_bavail == 0 or sum(f.stat().st_size for f in small_fs.rglob("*.kv")) > 0
    assert m["kvpool_free_blocks"] == 11
