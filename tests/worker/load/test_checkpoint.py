"""Loading checkpoints: sharded ones load; a truncated file, a missing tensor, a wrong
shape, an unknown architecture or a context past a disabled sliding window is each a
clear error naming the file or tensor, and the worker exits non-zero before hello."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import torch
import zmq
from kvtest.hf_models import make_checkpoint
from safetensors.torch import load_file, save_file

from worker.load.checkpoint import Checkpoint, CheckpointError
from worker.load.serving_model import load_serving_model
from worker.models.config import ModelConfigError
from worker.models.loader import load_model


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return make_checkpoint("llama", tmp_path_factory.mktemp("single"))


@pytest.fixture
def copy(single, tmp_path):
    return shutil.copytree(single, tmp_path / "ckpt")


def test_a_sharded_checkpoint_loads_and_equals_the_single_file(single, tmp_path):
    sharded = make_checkpoint("llama", tmp_path / "sharded", max_shard_size="100KB")
    files = sorted(p.name for p in sharded.glob("*.safetensors"))
    assert len(files) > 1 and (sharded / "model.safetensors.index.json").is_file()
    a, b = load_model(Checkpoint(single), torch.float32, "cpu"), load_model(Checkpoint(sharded), torch.float32, "cpu")
    assert torch.equal(a.lm_head, b.lm_head) and torch.equal(a.layers[1].qkv.weight, b.layers[1].qkv.weight)
    assert torch.equal(a.layers[0].mlp.down.weight, b.layers[0].mlp.down.weight)


def test_identity_follows_config_and_weights(single, copy, tmp_path):
    assert Checkpoint(single).identity() == Checkpoint(copy).identity()
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-5
    (copy / "config.json").write_text(json.dumps(cfg))
    assert Checkpoint(single).identity() != Checkpoint(copy).identity()


def test_truncated_safetensors_names_the_file(copy):
    path = copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="model.safetensors: not a readable safetensors file"):
        load_serving_model(str(copy), "auto", "cpu")


def test_missing_tensor_names_it(copy):
    path = copy / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(path))
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'"):
        load_serving_model(str(copy), "auto", "cpu")


def test_wrong_shape_names_the_tensor_and_both_shapes(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match=r"model\.safetensors: tensor 'model\.layers\.0\.mlp\.gate_proj\.weight' has shape \(128, 64\), config\.json says \(96, 64\)"):
        load_serving_model(str(copy), "auto", "cpu")


def test_unknown_architecture_names_it_and_the_supported_ones(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (copy / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelConfigError, match="architecture 'GPT2LMHeadModel' is not supported") as e:
        load_serving_model(str(copy), "auto", "cpu")
    for arch in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "MistralForCausalLM"):
        assert arch in str(e.value)


def test_a_sliding_window_model_is_served_past_its_window_unless_disabled(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg.update(architectures=["MistralForCausalLM"], model_type="mistral", sliding_window=256, max_position_embeddings=4096)
    (copy / "config.json").write_text(json.dumps(cfg))
    s = load_serving_model(str(copy), "auto", "cpu")
    # Every layer attends within its window of 256: one sliding-window KV-cache group.
    assert s.max_model_len == 4096 and s.layer_windows == (256, 256)  # two layers
    assert [(g.layer_ids, g.sliding_window) for g in s.kv_cache_groups] == [([0, 1], 256)]
    # --disable-sliding-window, as vLLM: every layer full attention, the context capped at the window.
    s = load_serving_model(str(copy), "auto", "cpu", disable_sliding_window=True)
    assert s.max_model_len == 256 and s.layer_windows == (0, 0)
    assert [(g.layer_ids, g.sliding_window) for g in s.kv_cache_groups] == [([0, 1], 0)]
    with pytest.raises(ModelConfigError, match="max_model_len 1000 is longer than the model's sliding window 256 \\(--disable-sliding-window\\)"):
        load_serving_model(str(copy), "auto", "cpu", max_model_len=1000, disable_sliding_window=True)


def test_dtype_auto_is_the_checkpoint_dtype(copy):
    cfg = json.loads((copy / "config.json").read_text())
    cfg["dtype"] = "bfloat16"
    (copy / "config.json").write_text(json.dumps(cfg))
    s = load_serving_model(str(copy), "auto", "cpu")
    assert s.dtype == "bfloat16" and s.model.lm_head.dtype == torch.bfloat16
    assert load_serving_model(str(copy), "float32", "cpu").model.lm_head.dtype == torch.float32


def test_eos_ids_from_config_and_generation_config(copy):
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 1, 9]}))
    assert load_serving_model(str(copy), "auto", "cpu").config.eos_token_ids == (1, 7, 9)


def _break_weights(d):
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header")
    return "model.safetensors"


def _unknown_architecture(d):
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["FalconForCausalLM"]
    (d / "config.json").write_text(json.dumps(cfg))
    return "FalconForCausalLM"


@pytest.mark.e2e
@pytest.mark.parametrize("breakage", [_break_weights, _unknown_architecture])
def test_the_worker_exits_nonzero_before_hello_on_a_bad_checkpoint(copy, breakage):
    named = breakage(copy)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind("tcp://127.0.0.1:0")
    endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
    try:
        proc = subprocess.run([sys.executable, "-m", "worker", "--scheduler", endpoint, "--model", str(copy), "--device", "cpu",
                               "--http-port", "0"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2
        assert "cannot serve this checkpoint" in proc.stderr and named in proc.stderr
        assert not sock.poll(200)  # it never said hello
    finally:
        sock.close(linger=0)
        ctx.term()
