"""What one tensor-parallel rank loads, in process (no group needed to load): only its
slices of each sharded tensor, read straight from the safetensors file, equal to the
rows/columns of the whole model's; replicated KV heads; a wrong N refused naming the
dimension; a wrong tensor shape still named as such."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from worker.load.checkpoint import Checkpoint, CheckpointError
from worker.models.config import model_config_from_hf
from worker.models.loader import load_model
from worker.parallel.linear import RowParallelLinear, ShardError, plan_shard
from worker.tiny.generate import CONFIG


def _no_group(_t: torch.Tensor) -> None:
    raise AssertionError("loading runs no collective")


@pytest.fixture(scope="module")
def whole(tiny_checkpoint):
    return load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_loads_its_slices_of_every_sharded_tensor(tiny_checkpoint, whole, rank):
    c = whole.config  # 8 query heads, 2 KV heads of 32, intermediate 768
    shard = plan_shard(c, rank, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.kv_head_start, shard.intermediate_size) == (4, 1, rank, 384)
    part = load_model(Checkpoint(tiny_checkpoint), torch.float32, "cpu", c, shard, _no_group)
    assert (part.num_heads, part.num_kv_heads) == (4, 1)
    hd, q, kv, inter = c.head_dim, c.q_size, c.kv_size, c.intermediate_size
    for mine, full in zip(part.layers, whole.layers, strict=True):
        fq, fk, fv = full.qkv.dense_weight().split((q, kv, kv))
        expected_qkv = torch.cat([fq[rank * 4 * hd : (rank + 1) * 4 * hd], fk[rank * hd : (rank + 1) * hd], fv[rank * hd : (rank + 1) * hd]])
        assert torch.equal(mine.qkv.dense_weight(), expected_qkv)
        assert isinstance(mine.o, RowParallelLinear) and isinstance(mine.mlp.down, RowParallelLinear)
        assert torch.equal(mine.o.dense_weight(), full.o.dense_weight()[:, rank * 4 * hd : (rank + 1) * 4 * hd])
        gate, up = full.mlp.gate_up.dense_weight().split((inter, inter))
        half = slice(rank * inter // 2, (rank + 1) * inter // 2)
        assert torch.equal(mine.mlp.gate_up.dense_weight(), torch.cat([gate[half], up[half]]))
        assert torch.equal(mine.mlp.down.dense_weight(), full.mlp.down.dense_weight()[:, half])
        assert torch.equal(mine.input_norm, full.input_norm)
    # Replicated: the embedding and lm_head whole on every rank.
    assert torch.equal(part.embed, whole.embed) and torch.equal(part.lm_head, whole.lm_head)


def test_fewer_kv_heads_than_ranks_are_replicated_and_uneven_splits_refused():
    c = model_config_from_hf(CONFIG)  # 8 heads, 2 KV heads
    assert [plan_shard(c, r, 4).kv_head_start for r in range(4)] == [0, 0, 1, 1]
    assert [plan_shard(c, r, 8).kv_head_start for r in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    with pytest.raises(ShardError, match="num_attention_heads 8 is not divisible by --tensor-parallel-size 3"):
        plan_shard(c, 0, 3)
    c6 = model_config_from_hf({**CONFIG, "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 32})
    with pytest.raises(ShardError, match="num_key_value_heads 6 is not divisible by --tensor-parallel-size 4"):
        plan_shard(c6, 0, 4)
    c3 = model_config_from_hf({**CONFIG, "num_attention_heads": 12, "num_key_value_heads": 3, "head_dim": 32,
                               "intermediate_size": 768})
    with pytest.raises(ShardError, match="num_key_value_heads 3 is fewer than --tensor-parallel-size 4 and does not divide it"):
        plan_shard(c3, 0, 4)
    with pytest.raises(ShardError, match="intermediate_size 769 is not divisible by --tensor-parallel-size 2"):
        plan_shard(model_config_from_hf({**CONFIG, "intermediate_size": 769}), 0, 2)


def test_a_wrong_shape_is_named_when_only_a_slice_is_read(tiny_checkpoint, tmp_path):
    for f in ("config.json", "generation_config.json"):
        (tmp_path / f).write_text((tiny_checkpoint / f).read_text())
    w = load_file(str(tiny_checkpoint / "model.safetensors"))
    w["model.layers.1.mlp.down_proj.weight"] = w["model.layers.1.mlp.down_proj.weight"][:, :100].contiguous()
    save_file(w, str(tmp_path / "model.safetensors"))
    c = model_config_from_hf(json.loads((tmp_path / "config.json").read_text()))
    with pytest.raises(CheckpointError, match=r"down_proj.weight' has shape \(256, 100\), config.json says \(256, 768\)"):
        load_model(Checkpoint(tmp_path), torch.float32, "cpu", c, plan_shard(c, 1, 2), _no_group)
