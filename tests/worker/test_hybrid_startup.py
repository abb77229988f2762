"""A hybrid worker's start-up: the KV cache sized by ``num_kv_tensors`` (worked by hand),
layers of different groups sharing tensors, the hello's group windows, the runner built
with the groups, the host and external tiers started over the distinct KV tensors (the
hello's block bytes what a host slot holds), and the flags."""

from __future__ import annotations

import dataclasses

import pytest

import worker.startup
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import WorkerReady
from worker.config import WorkerConfig
from worker.load.serving_model import load_serving_model
from worker.process import WorkerProcess
from worker.startup import allocate_worker_kv_caches

# Gemma-style windows on the tiny checkpoint's 4 layers: two groups of two layers.
GROUPS = (KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0))


@pytest.fixture(scope="module")
def serving(tiny_checkpoint):
    return load_serving_model(tiny_checkpoint, "float32", "cpu", 64)


@pytest.fixture(scope="module")
def hybrid(serving):
    return dataclasses.replace(serving, layer_windows=(8, 0, 8, 0), kv_cache_groups=GROUPS)


def test_the_cache_is_sized_by_the_kv_tensors_not_the_layers(serving, hybrid):
    config = WorkerConfig(block_size=4, kv_cache_memory=64 * 1024)
    # The tiny checkpoint: 2 KV heads of 32 dims, float32. One block of one layer:
    # K and V, 4 tokens: 2 * 4 * 2 * 32 * 4 bytes = 2048.
    caches, per_block = allocate_worker_kv_caches(config, serving, None)
    assert per_block == 4 * 2048 and len(caches) == 4 and len({id(kv) for kv in caches}) == 4
    assert caches[0].shape == (2, 65536 // 8192, 4, 2, 32)
    # Two groups of two layers: 2 tensors, so a block costs 2 layers and twice as many fit.
    caches, per_block = allocate_worker_kv_caches(config, hybrid, None)
    assert per_block == 2 * 2048 and caches[0].shape == (2, 65536 // 4096, 4, 2, 32)
    # Tensor j holds the j-th layer of every group: layers 0 and 1, then layers 2 and 3.
    assert caches[0] is caches[1] and caches[2] is caches[3] and caches[0] is not caches[2]


def test_the_hello_says_the_group_windows_and_the_runner_gets_the_groups(serving, hybrid):
    config = WorkerConfig(block_size=4, kv_cache_memory=64 * 1024)
    assert WorkerProcess(config, serving, allocate_worker_kv_caches(config, serving, None)[0], None).hello().group_windows == []
    proc = WorkerProcess(config, hybrid, allocate_worker_kv_caches(config, hybrid, None)[0], None)
    assert proc.hello().group_windows == [8, 0] and proc.hello().num_blocks == 16
    assert proc._install(WorkerReady(10, 4, 2, 32)) is None
    r = proc.runner
    assert r.limits.group_windows == (8, 0) and len(r.groups.tables) == 2 and r.limits.num_blocks == 10
    kv = r.attention.kv_caches  # cut to WorkerReady's 10 blocks, still shared
    assert kv[0].shape[1] == 10 and kv[0] is kv[1] and kv[2] is kv[3] and kv[0] is not kv[2]


def started(config: WorkerConfig, serving, monkeypatch) -> dict:
    """What start-up hands the process loop (kv_caches, host_caches, external), run as
    ``python -m worker`` runs it after the load; the loop itself returns at once."""
    handed = {}

    def loop(config, serving, kv_caches, metrics, group, host_caches, external=None, transfer=None):
        handed.update(kv_caches=kv_caches, host_caches=host_caches, external=external,
                      hello=WorkerProcess(config, serving, kv_caches, None, host_caches, external).hello())
        return 0

    monkeypatch.setattr(worker.startup, "_run_process_loop", loop)
    assert worker.startup._serve(config, serving, None) == 0
    return handed


def test_a_hybrid_worker_starts_with_a_host_tier(hybrid, monkeypatch):
    # 1/1024 GiB = 1 MiB of host tier; a block is 2 tensors of 2048 bytes: 256 host blocks.
    config = WorkerConfig(block_size=4, kv_cache_memory=64 * 1024, kv_offloading_size=1 / 1024, http_port=0)
    got = started(config, hybrid, monkeypatch)
    kv, host, hello = got["kv_caches"], got["host_caches"], got["hello"]
    assert len(kv) == 4 and len(host) == 2  # one host tensor per distinct KV tensor, not per layer
    assert [tuple(h.shape) for h in host] == [(2, 256, 4, 2, 32)] * 2
    assert hello.kv_block_bytes == 4096 and hello.num_host_blocks == 256 and hello.group_windows == [8, 0]
    assert sum(h.numel() * h.element_size() for h in host) == hello.num_host_blocks * hello.kv_block_bytes


def test_a_hybrid_worker_starts_with_a_disk_tier(hybrid, serving, monkeypatch, tmp_path):
    config = WorkerConfig(block_size=4, kv_cache_memory=64 * 1024, http_port=0, kv_offloading_backend="disk",
                          kv_offloading_path=str(tmp_path), kv_offloading_disk_bytes=1 << 20)
    got = started(config, hybrid, monkeypatch)
    io, hello = got["external"], got["hello"]
    kv = got["kv_caches"]
    assert len(io.kv_caches) == 2 and io.kv_caches[0] is kv[0] and io.kv_caches[1] is kv[2]
    assert io.block_bytes == hello.kv_block_bytes == 4096
    assert hello.external_tier == "disk" and hello.external_identity == io.identity
    # The same checkpoint with one full group keeps its objects apart: another identity, another directory.
    one = started(config, serving, monkeypatch)["external"]
    assert one.identity != io.identity and one.store.dir != io.store.dir and one.block_bytes == 4 * 2048


def test_the_flags_reach_the_config():
    from worker.__main__ import config_from_args

    c = config_from_args(["--device", "cpu"])
    assert not c.disable_hybrid_kv_cache_manager and not c.disable_sliding_window
    c = config_from_args(["--device", "cpu", "--disable-hybrid-kv-cache-manager", "--disable-sliding-window"])
    assert c.disable_hybrid_kv_cache_manager and c.disable_sliding_window


def test_groups_that_cannot_be_made_are_a_checkpoint_error(serving, monkeypatch):
    # As vLLM, --disable-hybrid-kv-cache-manager refuses layers of several window sizes
    # (protocol.kv_cache_spec raises ValueError): the worker exits 2 naming it, not a traceback.
    import worker.load.serving_model as sm

    def refuse(windows, disable_hybrid):
        raise ValueError("--disable-hybrid-kv-cache-manager needs at most one sliding window size, got [8, 16]")

    monkeypatch.setattr(sm, "kv_cache_groups", refuse)
    with pytest.raises(sm.ModelConfigError, match="needs at most one sliding window size"):
        sm.serving_windows(serving.config, False, True)
