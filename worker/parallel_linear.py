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


def shard_rows(w: torch.Tensor | None, start: int, n: int) -> torch.Tensor | None:
    """Rows [start, start + n) of an (out, in) weight or (out,) bias, as its own tensor."""
    return None if w is None else w.narrow(0, start, n).clone()


def shard_columns(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    """Columns [start, start + n) of an (out, in) weight, contiguous."""
    return w.narrow(1, start, n).contiguous()


def shard_qkv(q: torch.Tensor | None, k: torch.Tensor | None, v: torch.Tensor | None, s: TPShard, head_dim: int) -> torch.Tensor | None:
    """This rank's q, k and v rows (weights (heads * hd, H) or biases), fused in that order."""
    if q is None:
        return None
    kv0, nkv = s.kv_head_start * head_dim, s.num_kv_heads * head_dim
    return torch.cat([shard_rows(q, s.q_start * head_dim, s.num_heads * head_dim), shard_rows(k, kv0, nkv), shard_rows(v, kv0, nkv)])


def shard_gate_up(gate: torch.Tensor, up: torch.Tensor, s: TPShard) -> torch.Tensor:
    """This rank's gate and up rows, fused so that ``chunk(2)`` splits them again."""
    n = s.intermediate_size
    return torch.cat([shard_rows(gate, s.rank * n, n), shard_rows(up, s.rank * n, n)])


AllReduce = Callable[[torch.Tensor], None]  # sums a tensor over the group, in place


@dataclass(slots=True)
class RowParallelLinear:
    """y = all_reduce(x_shard @ w_shard.T) + bias: the bias is added once, after the sum."""

    weight: torch.Tensor  # (out, in / N)
    bias: torch.Tensor | None  # (out,), whole
    all_reduce: AllReduce

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)  # (..., out), this rank's partial sum
        self.all_reduce(y)
        return y if self.bias is None else y + self.bias
