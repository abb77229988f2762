"""GGUF weights (worker/load/gguf_weights.py) dequantized as transformers dequantizes them: the
real SmolLM2-135M-Instruct GGUF that ``make install`` brings (Q4_1 and Q8_0 tensors, a
Llama's permuted Q and K rows), every tensor equal to transformers' own, bit for bit; and
for each architecture kvpool serves, a model written as llama.cpp's converter writes it
read back to its weights; files kvpool cannot serve refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import MODEL_ARCH_NAMES, GGUFWriter, get_tensor_name_map
from kvtest.hf_models import make_checkpoint
from kvtest.real_data import real_model

from frontend.serve.gguf_model import GGUFModelError, check_gguf, gguf_model_dir
from worker.load.checkpoint import Checkpoint, CheckpointError
from worker.models.config import model_config_from_hf
from worker.models.loader import expected_shapes, load_model


@pytest.fixture(scope="module")
def real_gguf() -> Path:
    return real_model()


@pytest.fixture(scope="module")
def real_dir(real_gguf, _kvpool_cache_dir):
    """The folder kvpool serve writes for the real GGUF (in the session's cache folder)."""
    return gguf_model_dir(real_gguf)


@pytest.mark.slow
def test_every_tensor_equals_transformers_dequantization_of_the_same_file(real_gguf, real_dir):
    from transformers import AutoModelForCausalLM

    ckpt = Checkpoint(real_dir)
    config = model_config_from_hf(ckpt.config, ckpt.generation_config, str(ckpt.config_path))
    names = list(expected_shapes(config))
    ours = ckpt.load(names, torch.float32, "cpu")
    theirs = AutoModelForCausalLM.from_pretrained(str(real_gguf.parent), gguf_file=real_gguf.name, dtype=torch.float32).state_dict()
    assert len(names) == 30 * 9 + 2  # 9 tensors a layer, the embeddings (tied: the LM head too) and the final norm
    differ = [n for n in names if not torch.equal(ours[n], theirs[n])]
    assert differ == []
    # and the model assembles from them, in the serving dtype
    model = load_model(ckpt, torch.bfloat16, "cpu")
    assert model.tied and model.config.num_layers == 30


def test_the_folder_holds_what_every_process_reads(real_gguf, real_dir):
    files = {p.name for p in real_dir.iterdir()}
    assert {"config.json", "generation_config.json", "tokenizer.json", "model.gguf"} <= files
    assert (real_dir / "model.gguf").resolve() == real_gguf.resolve()
    assert gguf_model_dir(real_gguf) == real_dir  # written once, found again
    assert Checkpoint(real_dir).identity() == Checkpoint(real_dir).identity()


def write_gguf(path, arch: str, tensors: dict[str, np.ndarray]) -> None:
    w = GGUFWriter(str(path), arch)
    for name, data in tensors.items():
        w.add_tensor(name, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_an_architecture_kvpool_does_not_serve_is_refused_by_name(tmp_path):
    write_gguf(tmp_path / "m.gguf", "bert", {"token_embd.weight": np.ones((4, 8), np.float32)})
    with pytest.raises(GGUFModelError, match="GGUF architecture 'bert' is not served"):
        check_gguf(tmp_path / "m.gguf")


def test_a_tensor_the_gguf_package_cannot_dequantize_is_refused_by_name(tmp_path):
    write_gguf(tmp_path / "m.gguf", "llama", {"token_embd.weight": np.ones((4, 8), np.float32),
                                               "output_norm.weight": np.ones(8, np.float64)})
    with pytest.raises(GGUFModelError, match="tensor 'output_norm.weight' is F64, which the gguf package cannot dequantize"):
        check_gguf(tmp_path / "m.gguf")


def test_a_folder_of_two_gguf_files_or_a_broken_one_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"num_attention_heads": 2, "num_key_value_heads": 1}')
    (tmp_path / "a.gguf").write_bytes(b"not a gguf")
    with pytest.raises(CheckpointError, match="not a readable GGUF file"):
        Checkpoint(tmp_path)
    (tmp_path / "b.gguf").write_bytes(b"")
    with pytest.raises(CheckpointError, match="2 GGUF files"):
        Checkpoint(tmp_path)


def as_llama_cpp_converts(kind: str, hf_dir, gguf_path) -> dict[str, torch.Tensor]:
    """Write ``hf_dir``'s weights into a float32 GGUF as llama.cpp's converter does (gguf's
    names; a Llama's Q and K rows permuted for its RoPE; Gemma's norms plus 1); returns
    what reading it back must give: the weights, through that conversion and its undoing."""
    from safetensors.torch import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    arch = {"gemma3": "gemma3"}.get(kind, kind)
    names = get_tensor_name_map(next(k for k, v in MODEL_ARCH_NAMES.items() if v == arch), config["num_hidden_layers"])
    w = GGUFWriter(str(gguf_path), arch)
    want = {}
    for name, t in weights.items():
        base, suffix = name.rsplit(".", 1)
        a = t.numpy()
        if kind == "llama" and base.endswith(("q_proj", "k_proj")):
            heads = config["num_attention_heads" if base.endswith("q_proj") else "num_key_value_heads"]
            a = a.reshape(heads, 2, a.shape[0] // heads // 2, *a.shape[1:]).swapaxes(1, 2).reshape(a.shape)
        if kind == "gemma3" and base.endswith("norm"):
            a = a + np.float32(1)
            t = torch.from_numpy(a - np.float32(1))  # the float32 round trip through + 1 and - 1
        w.add_tensor(f"{names.get_name(base)}.{suffix}", np.ascontiguousarray(a))
        want[name] = t
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return want


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "gemma3"])
def test_each_architecture_reads_back_the_weights_llama_cpp_converted(kind, tmp_path):
    """The GGUF names of each architecture kvpool serves, and what its converter did undone:
    every tensor back bit for bit (Gemma's norms as float32 rounds w + 1 - 1)."""
    hf_dir = make_checkpoint(kind, tmp_path / "hf")
    folder = tmp_path / "gguf"
    folder.mkdir()
    (folder / "config.json").write_text((hf_dir / "config.json").read_text())
    want = as_llama_cpp_converts(kind, hf_dir, folder / "model.gguf")
    ckpt = Checkpoint(folder)
    config = model_config_from_hf(ckpt.config, None, str(ckpt.config_path))
    names = list(expected_shapes(config))
    got = ckpt.load(names, torch.float32, "cpu")
    assert set(names) <= set(want)
    assert [n for n in names if not torch.equal(got[n], want[n])] == []
