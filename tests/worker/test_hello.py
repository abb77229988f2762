"""The hello reports the KV cache as the worker allocated it (its torch dtype, that
element's bytes, the bytes of one block) and the weights' dtype: facts the scheduler and
the launcher read rather than derive. Expected values are worked from the tiny
checkpoint's shape here, not by the code under test."""

from __future__ import annotations

import dataclasses

import pytest

from protocol.kv_cache_spec import KVCacheGroupSpec
from worker.config import WorkerConfig
from worker.load.serving_model import load_serving_model
from worker.process import WorkerProcess
from worker.startup import allocate_worker_kv_caches

# The tiny checkpoint: 4 layers, 2 KV heads of 32 dims; blocks of 4 tokens here.
LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 32, 4


def hello_of(serving, kv_cache_dtype: str = "auto"):
    config = WorkerConfig(block_size=BLOCK, kv_cache_memory=256 * 1024, kv_cache_dtype=kv_cache_dtype)
    return WorkerProcess(config, serving, allocate_worker_kv_caches(config, serving, None)[0], None).hello()


@pytest.mark.parametrize(("dtype", "kv_cache_dtype", "want_kv", "kv_size", "size"), [
    ("float32", "auto", "float32", 4, 4),
    ("bfloat16", "auto", "bfloat16", 2, 2),
    ("bfloat16", "fp8", "float8_e4m3fn", 1, 2),
    ("float32", "fp8_e5m2", "float8_e5m2", 1, 4),
])
def test_the_hello_says_the_kv_dtype_and_the_bytes_of_a_block(tiny_checkpoint, dtype, kv_cache_dtype, want_kv, kv_size, size):
    hello = hello_of(load_serving_model(tiny_checkpoint, dtype, "cpu", 64), kv_cache_dtype)
    assert (hello.kv_cache_dtype, hello.kv_cache_dtype_size, hello.dtype, hello.dtype_size) == (want_kv, kv_size, dtype, size)
    # K and V of every layer: 2 * 4 layers * 4 tokens * 2 heads * 32 dims elements.
    assert hello.kv_block_bytes == 2 * LAYERS * BLOCK * KV_HEADS * HEAD_DIM * kv_size
    # And the blocks promised fit the budget at that size.
    assert hello.num_blocks == 256 * 1024 // hello.kv_block_bytes


def test_a_kv_tensor_that_layers_of_two_groups_share_counts_once(tiny_checkpoint):
    serving = load_serving_model(tiny_checkpoint, "float32", "cpu", 64)
    hybrid = dataclasses.replace(serving, layer_windows=(8, 0, 8, 0),
                                 kv_cache_groups=(KVCacheGroupSpec([0, 2], 8), KVCacheGroupSpec([1, 3], 0)))
    # Two groups of two layers: 2 KV tensors, each block K and V of 2 tensors at 4 bytes.
    assert hello_of(hybrid).kv_block_bytes == 2 * 2 * BLOCK * KV_HEADS * HEAD_DIM * 4
