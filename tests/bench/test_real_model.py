"""The speed rows' real inputs (bench/real_model.py): ShareGPT's cut-off file written out
as the whole JSON document ``vllm bench serve`` reads; SmolLM2's bfloat16 folder holds
the tensors kvpool dequantizes from the GGUF (those equal transformers' own:
tests/worker/load/test_gguf_weights.py), under the names a Hugging Face folder gives them."""

from __future__ import annotations

import json

import pytest
import torch
from kvtest.real_data import real_model

from bench.real_model import sharegpt_json, smollm2_checkpoint


def test_a_cut_off_sharegpt_file_becomes_its_whole_conversations(tmp_path):
    convs = [{"id": str(i), "conversations": [{"from": "human", "value": f"q{i}"}, {"from": "gpt", "value": f"a{i}"}]} for i in range(3)]
    whole = json.dumps(convs)
    src = tmp_path / "cut.json"
    src.write_text(whole[: whole.index('{"id": "2"') + 12])  # the third one cut off inside
    out = sharegpt_json(tmp_path / "out" / "sharegpt.json", src)
    assert json.loads(out.read_text()) == convs[:2]
    src.write_text("[]")
    assert json.loads(sharegpt_json(out, src).read_text()) == convs[:2]  # written once


@pytest.mark.slow
def test_the_smollm2_folder_holds_the_ggufs_tensors_in_bfloat16():
    gguf = real_model()
    from safetensors.torch import load_file

    from worker.load.gguf_weights import GGUFWeights

    folder = smollm2_checkpoint()
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and (folder / "tokenizer.json").is_file()
    tensors = load_file(str(folder / "model.safetensors"))
    assert len(tensors) == 272 and all(t.dtype == torch.bfloat16 for t in tensors.values())
    ref = GGUFWeights(gguf, config["num_attention_heads"], config["num_key_value_heads"])
    for name in ("model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.layers.29.mlp.down_proj.weight"):
        assert torch.equal(tensors[name], ref.load(name, torch.float32, "cpu").to(torch.bfloat16))
