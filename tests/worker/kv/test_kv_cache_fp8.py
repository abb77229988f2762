"""An fp8 KV cache's sizing and bytes: the worker's start-up gives exactly twice a bf16
cache's blocks for the same --kv-cache-memory, and vLLM's CPU count for the same KV
space (vLLM's formula, worked by hand below); the checkpoint's scales are read as vLLM
reads them; the host tier moves the fp8 bytes bit for bit."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from protocol.worker_messages import RequestRow, StepPlan, TierCopies
from worker.__main__ import config_from_args
from worker.attention.kv_quant import KVScales
from worker.kv.kv_cache import allocate_host_kv_caches
from worker.load.checkpoint import Checkpoint, CheckpointError
from worker.load.serving_model import load_serving_model
from worker.models.kv_scales import read_kv_scales
from worker.startup import allocate_worker_kv_caches
from worker.step.runner import ModelRunner


@pytest.fixture(scope="module")
def serving(tiny_checkpoint):
    return load_serving_model(str(tiny_checkpoint), "bfloat16", "cpu", 256)


def blocks(serving, *flags: str) -> tuple[list[torch.Tensor], int]:
    return allocate_worker_kv_caches(config_from_args(["--device", "cpu", "--http-port", "0", *flags]), serving, None)


def test_the_same_memory_holds_twice_the_blocks_of_bf16(serving):
    bf16, bf16_block = blocks(serving, "--kv-cache-memory", "8MiB")
    assert bf16[0].dtype == torch.bfloat16
    for name, fp8 in (("fp8", torch.float8_e4m3fn), ("fp8_e4m3", torch.float8_e4m3fn), ("fp8_e5m2", torch.float8_e5m2)):
        caches, per_block = blocks(serving, "--kv-cache-memory", "8MiB", "--kv-cache-dtype", name)
        assert caches[0].dtype == fp8 and per_block * 2 == bf16_block
        assert caches[0].shape[1] == 2 * bf16[0].shape[1]


def test_the_block_count_is_vllms_for_the_same_kv_space(serving):
    # vLLM 0.32 on CPU: VLLM_CPU_KVCACHE_SPACE=1 -> kv_cache_memory_bytes = 1 GiB
    # (platforms/cpu.py); each layer's page is block_size * num_kv_heads * head_size * 2
    # (K and V) * 1 byte (fp8 is stored as uint8: utils/torch_utils.py), and
    # num_blocks = available_memory // (page * layers) (v1/core/kv_cache_utils.py).
    # The tiny checkpoint: 4 layers, 2 KV heads, head_dim 32; --block-size 32.
    m = serving.config
    assert (m.num_layers, m.num_kv_heads, m.head_dim) == (4, 2, 32)
    vllm_blocks = 2**30 // (32 * 2 * 32 * 2 * 1 * 4)
    assert vllm_blocks == 65536
    caches, _ = blocks(serving, "--kv-cache-memory", "1GiB", "--kv-cache-dtype", "fp8", "--block-size", "32")
    assert caches[0].shape[1] == vllm_blocks


def test_a_cache_dtype_the_worker_does_not_know_is_refused(capsys):
    with pytest.raises(SystemExit):
        config_from_args(["--kv-cache-dtype", "int8"])
    assert "argument --kv-cache-dtype: invalid choice: 'int8'" in capsys.readouterr().err


def test_the_host_tier_moves_the_fp8_bytes_as_they_are(serving):
    """Prefill into device blocks, store them to host slots, load them into other device
    blocks: every byte equal, and an fp8 NaN-like pattern is no float to round."""
    m = serving.config
    caches, _ = blocks(serving, "--kv-cache-memory", "1MiB", "--kv-cache-dtype", "fp8", "--block-size", "4")
    hosts = allocate_host_kv_caches(caches, 8)
    assert hosts[0].dtype == torch.float8_e4m3fn
    r = ModelRunner(serving.model, caches, 3, 32, host_caches=hosts, kv_scales=[KVScales(0.5, 2.0)] * m.num_layers)
    r.execute(StepPlan(0, {1: 10}, new_rows=[RequestRow(1, [11, 22, 33, 44, 55, 66, 77, 88, 99, 5], [5, 9, 12])]))
    caches[0][:, 9, 0, 0, 0] = torch.tensor([0x7F, 0xFF], dtype=torch.uint8).view(torch.float8_e4m3fn)  # E4M3's NaNs
    before = [kv[:, [5, 9]].view(torch.uint8).clone() for kv in caches]
    assert any(b.any() for b in before)
    r.execute(StepPlan(1, {}, tier_copies=TierCopies(store_device_ids=[5, 9], store_host_ids=[2, 6])))
    assert all(torch.equal(h[:, [2, 6]].view(torch.uint8), b) for h, b in zip(hosts, before, strict=True))
    r.execute(StepPlan(2, {}, tier_copies=TierCopies(load_host_ids=[2, 6], load_device_ids=[20, 21])))
    assert all(torch.equal(kv[:, [20, 21]].view(torch.uint8), b) for kv, b in zip(caches, before, strict=True))


def scaled_checkpoint(src, dst, quantized: bool, tensors: dict[str, torch.Tensor]):
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    weights = load_file(files[0])
    save_file({**weights, **tensors}, files[0])
    if quantized:
        config = json.loads((dst / "config.json").read_text())
        config["quantization_config"] = {"quant_method": "fp8"}
        (dst / "config.json").write_text(json.dumps(config))
    return Checkpoint(dst)


def test_scales_come_from_a_quantized_checkpoint_as_vllm_reads_them(tiny_checkpoint, tmp_path):
    scales = {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor(0.5), "model.layers.0.self_attn.v_proj.v_scale": torch.tensor(2.0),
              "model.layers.1.self_attn.kv_scale": torch.tensor([3.0]), "model.layers.2.self_attn.attn.v_scale": torch.tensor(0.25)}
    # vLLM reads them only through a quantization config's scale parameters.
    assert read_kv_scales(scaled_checkpoint(tiny_checkpoint, tmp_path / "plain", False, scales), 4) == [KVScales()] * 4
    got = read_kv_scales(scaled_checkpoint(tiny_checkpoint, tmp_path / "quant", True, scales), 4)
    # Layer 1: the deprecated kv_scale is K's, and one scale serves both; layer 3: none, 1.0.
    assert got == [KVScales(0.5, 2.0), KVScales(3.0, 3.0), KVScales(0.25, 0.25), KVScales()]
    bad = scaled_checkpoint(tiny_checkpoint, tmp_path / "bad", True, {"model.layers.0.self_attn.k_scale": torch.ones(2)})
    assert read_kv_scales(bad, 4)[0] == KVScales()  # not a name vLLM maps onto the layer
    bad = scaled_checkpoint(tiny_checkpoint, tmp_path / "bad2", True, {"model.layers.0.self_attn.attn.k_scale": torch.ones(2)})
    with pytest.raises(CheckpointError, match="only a per-tensor scaling factor"):
        read_kv_scales(bad, 4)
