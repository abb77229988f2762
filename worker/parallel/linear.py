"""Megatron-style tensor-parallel sharding of the decoder's weights, as vLLM shards them
(``vllm/model_executor/layers/linear.py``: ``QKVParallelLinear``,
``MergedColumnParallelLinear``, ``RowParallelLinear``).

* Column-parallel (q/k/v, gate/up): each rank keeps a slice of the output rows, so its
  output is a slice of the full output and needs no communication.
* Row-parallel (o_proj, down_proj): each rank keeps the matching slice of the input
  columns; the partial products are summed by one all-reduce, then the bias (if any) is
  added once.
* Attention heads are split across ranks: rank r holds query heads
  ``[r * nh / N, (r + 1) * nh / N)``. KV heads are split the same way when there are at
  least N of them; with fewer (N a multiple of the KV head count) each KV head is
  replicated on N / kvh ranks and rank r holds KV head ``r // (N / kvh)``, the one its
  query heads read (vLLM's ``num_kv_head_replicas``).
* Embedding and lm_head are replicated (see docs/architecture.md, "Tensor parallelism").

Each rank reads only its slices from the safetensors files (``shard_spec``), as vLLM's
weight loaders narrow each tensor, so no rank holds the whole model even while loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from worker.models.config import ModelConfig, ModelConfigError


class ShardError(ModelConfigError):
    """A model that cannot be split over this many ranks; the message says why."""


@dataclass(frozen=True, slots=True)
class TPShard:
    """What rank ``rank`` of ``size`` holds of a model."""

    rank: int
    size: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank (1 when replicated)
    kv_head_start: int  # the first KV head this rank holds, of the model's
    intermediate_size: int  # MLP columns on this rank

    @property
    def q_start(self) -> int:
        return self.rank * self.num_heads


def plan_shard(config: ModelConfig, rank: int, size: int, where: str = "config.json") -> TPShard:
    """Rank ``rank``'s shard, or ShardError naming the dimension that does not divide."""
    if size < 1 or not 0 <= rank < size:
        raise ShardError(f"rank {rank} of tensor-parallel size {size}: need 0 <= rank < size")
    nh, kvh, inter = config.num_heads, config.num_kv_heads, config.intermediate_size
    if nh % size:
        raise ShardError(f"{where}: num_attention_heads {nh} is not divisible by --tensor-parallel-size {size}")
    if kvh >= size and kvh % size:
        raise ShardError(f"{where}: num_key_value_heads {kvh} is not divisible by --tensor-parallel-size {size}")
    if kvh < size and size % kvh:
        raise ShardError(
            f"{where}: num_key_value_heads {kvh} is fewer than --tensor-parallel-size {size} and does not divide it, "
            "so the KV heads cannot be replicated evenly"
        )
    if inter % size:
        raise ShardError(f"{where}: intermediate_size {inter} is not divisible by --tensor-parallel-size {size}")
    if kvh >= size:
        local_kv, kv_start = kvh // size, rank * (kvh // size)
    else:
        local_kv, kv_start = 1, rank // (size // kvh)
    return TPShard(rank, size, nh // size, local_kv, kv_start, inter // size)


Narrow = tuple[int, int, int]  # (dim, start, length) of a checkpoint tensor


def shard_spec(config: ModelConfig, s: TPShard) -> dict[str, Narrow]:
    """Which slice of each sharded checkpoint tensor rank ``s.rank`` reads (names absent
    are read whole: norms, embedding, lm_head, o_proj's bias)."""
    hd = config.head_dim
    q = (s.q_start * hd, s.num_heads * hd)
    kv = (s.kv_head_start * hd, s.num_kv_heads * hd)
    mlp = (s.rank * s.intermediate_size, s.intermediate_size)
    spec: dict[str, Narrow] = {}
    for i in range(config.num_layers):
        a, m = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        for suffix in ("weight", "bias") if config.qkv_bias else ("weight",):
            spec[f"{a}q_proj.{suffix}"] = (0, *q)  # column-parallel: output rows
            spec[f"{a}k_proj.{suffix}"] = (0, *kv)
            spec[f"{a}v_proj.{suffix}"] = (0, *kv)
        spec[f"{a}o_proj.weight"] = (1, *q)  # row-parallel: input columns
        spec[f"{m}gate_proj.weight"] = (0, *mlp)
        spec[f"{m}up_proj.weight"] = (0, *mlp)
        spec[f"{m}down_proj.weight"] = (1, *mlp)
    return spec


def narrowed_shape(shape: tuple[int, ...], narrow: Narrow | None) -> tuple[int, ...]:
    if narrow is None:
        return shape
    dim, _, length = narrow
    return shape[:dim] + (length,) + shape[dim + 1 :]


AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the group, in place


@dataclass(slots=True)
class RowParallelLinear:
    """y = all_reduce(x_shard @ w_shard.T) + bias: the bias is added once, after the sum."""

    weight: torch.Tensor  # (out, in / N)
    bias: torch.Tensor | None  # (out,), whole
    all_reduce: AllReduce
    out_dtype: torch.dtype | None = None  # as Linear's: the model's dtype, when the weights are wider

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.out_dtype is None:
            y = F.linear(x, self.weight)  # (..., out), this rank's partial sum
        else:  # NOTE: rounded before the sum, as a bfloat16 rank's partial sum is
            y = F.linear(x.to(self.weight.dtype), self.weight).to(self.out_dtype)
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias

    def dense_weight(self) -> torch.Tensor:
        """This rank's (out, in / N) weight (as ``Linear.dense_weight``)."""
        return self.weight
