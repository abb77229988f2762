"""Gemma 3 under tensor parallelism, in process: two ranks' shards (each its heads and MLP
columns, its norms whole) run side by side in two threads whose all-reduce meets at a
barrier, and give the whole model's logits; attention is dense here (causal, each
layer's window, Gemma's scale), the paged path being the one-rank tests' business."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from kvtest.hf_models import VOCAB, make_checkpoint

from worker.load.checkpoint import Checkpoint
from worker.models.loader import load_model
from worker.parallel.linear import plan_shard


def dense_attention(windows: tuple[int, ...], scale: float | None):
    def attention(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(q.shape[0])
        mask = pos[None, :] <= pos[:, None]  # (T, T)
        if windows[layer]:
            mask &= pos[None, :] > pos[:, None] - windows[layer]
        o = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        return o.transpose(0, 1)  # (T, nh, hd)

    return attention


class PairAllReduce:
    """Two threads' tensors summed in place, the same order on both."""

    def __init__(self):
        self.barrier = threading.Barrier(2, timeout=30)
        self.slots: list[torch.Tensor | None] = [None, None]

    def for_rank(self, rank: int):
        def all_reduce(t: torch.Tensor) -> None:
            self.slots[rank] = t.clone()
            self.barrier.wait()
            total = self.slots[0] + self.slots[1]
            self.barrier.wait()
            t.copy_(total)

        return all_reduce


def test_two_shards_give_the_whole_models_logits(tmp_path):
    path = make_checkpoint("gemma3", tmp_path)
    whole = load_model(Checkpoint(path), torch.float32, "cpu")
    c = whole.config
    tokens = torch.tensor([(11 * i) % (VOCAB - 2) + 2 for i in range(50)])  # several windows long
    positions = torch.arange(len(tokens))
    attention = dense_attention(c.layer_windows, c.attention_scale)
    expected = whole.compute_logits(whole.forward(tokens, positions, attention))
    pair, logits = PairAllReduce(), [None, None]

    def rank(r: int) -> None:
        part = load_model(
            Checkpoint(path), torch.float32, "cpu", c, plan_shard(c, r, 2), pair.for_rank(r)
        )
        logits[r] = part.compute_logits(part.forward(tokens, positions, attention))

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    # NOTE: one intra-op thread each: two ranks' pools on the same cores spin against each other.
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        torch.set_num_threads(num_threads)
    assert logits[0] is not None and logits[1] is not None
    torch.testing.assert_close(logits[0], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(logits[0], logits[1])
