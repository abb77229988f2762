"""A model driven through paged attention with one block table per KV-cache group, as
the runner does with hybrid groups (#26), without the runner: a test-side pool and
tables that behave as vLLM's hybrid manager leaves them.

* Groups, tensors and each layer's tensor: ``protocol.kv_cache_spec`` (vLLM's layout:
  tensor j shared by the j-th layer of every group; block ids unique across groups).
* A sliding group's row frees the blocks wholly before the window of the step's first
  query (vLLM's ``SlidingWindowManager.remove_skipped_blocks``): the null block (0)
  takes their place; a freed block goes to the back of an LRU free queue, still holding
  its K/V, so a later request can hit it (a prefix-cache hit on a sliding group).
* One metadata per distinct (group, layer window) pair, a list of them per layer: with
  ``disable_hybrid`` the one full group's sliding layers still attend within their windows.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch

from protocol.kv_cache_spec import kv_cache_groups, layer_tensor_index, num_kv_tensors
from worker.attention.paged_attention import PagedAttention
from worker.kv.kv_cache import allocate_kv_caches
from worker.models.decoder import DecoderModel


@dataclass
class Seq:
    tokens: list[int]
    row: int
    blocks: list[list[int]]  # per group, every block the sequence ever held, by column
    computed: int = 0
    num_prompt: int = 0
    out: list[int] = field(default_factory=list)
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, (V,))


class GroupedPagedModel:
    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, max_seqs: int = 4, max_blocks: int = 32,
                 disable_hybrid: bool = False):
        c = model.config
        self.model, self.bs = model, block_size
        self.groups = kv_cache_groups(c.layer_windows, disable_hybrid)
        tensors = allocate_kv_caches(
            num_kv_tensors(self.groups),
            num_blocks,
            block_size,
            c.num_kv_heads,
            c.head_dim,
            model.dtype,
            "cpu",
        )
        index = layer_tensor_index(self.groups)
        self.caches = tensors
        self.attention = PagedAttention([tensors[index[i]] for i in range(c.num_layers)], model.num_heads, max_blocks,
                                        compute_dtype=model.dtype, scale=c.attention_scale)
        group_of = {layer: g for g, spec in enumerate(self.groups) for layer in spec.layer_ids}
        self.layer_keys = [(group_of[i], c.layer_windows[i]) for i in range(c.num_layers)]
        self.tables = [torch.zeros((max_seqs, max_blocks), dtype=torch.int32) for _ in self.groups]
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(1, num_blocks))  # LRU first
        self.refs: dict[int, int] = {}
        self.seqs: dict[int, Seq] = {}
        self.num_allocated = 0
        self.num_nulled = 0

    def _take(self, block: int | None = None) -> int:
        if block is None:
            block, _ = self.free.popitem(last=False)
            self.num_allocated += 1
        elif block in self.free:
            del self.free[block]  # a hit on a freed, still cached block
        self.refs[block] = self.refs.get(block, 0) + 1
        return block

    def _drop(self, block: int) -> None:
        self.refs[block] -= 1
        if self.refs[block] == 0:
            self.free[block] = None

    def add(
        self,
        seq_id: int,
        prompt: list[int],
        share_from: int | None = None,
        num_shared_blocks: int = 0,
    ) -> None:
        """A new sequence; with ``share_from``, its first blocks are a prefix-cache hit on
        that sequence's (its prompt must start with the same tokens)."""
        row = len(self.seqs)
        seq = Seq(list(prompt), row, [[] for _ in self.groups], num_prompt=len(prompt))
        if share_from is not None:
            donor, k = self.seqs[share_from], num_shared_blocks
            assert donor.tokens[: k * self.bs] == prompt[: k * self.bs]
            seq.computed = k * self.bs
            for g, spec in enumerate(self.groups):
                # A sliding group hits only the blocks its window still needs (vLLM's hybrid coordinator).
                skipped = self._skipped_blocks(spec.sliding_window, seq.computed)
                seq.blocks[g] = [
                    self._take(b) if c >= skipped else 0 for c, b in enumerate(donor.blocks[g][:k])
                ]
                self.tables[g][row, :k] = torch.tensor(seq.blocks[g], dtype=torch.int32)
        self.seqs[seq_id] = seq

    def _skipped_blocks(self, window: int, num_computed: int) -> int:
        """Leading blocks wholly before the window of the query at ``num_computed``."""
        return max(0, num_computed - window + 1) // self.bs if window else 0

    def _prepare(self, seq: Seq, n: int) -> None:
        """Blocks for ``n`` more tokens in every group; a sliding group's skipped blocks freed."""
        for g, spec in enumerate(self.groups):
            blocks, table = seq.blocks[g], self.tables[g]
            while len(blocks) * self.bs < seq.computed + n:
                blocks.append(self._take())
                table[seq.row, len(blocks) - 1] = blocks[-1]
            for c in range(self._skipped_blocks(spec.sliding_window, seq.computed)):
                if table[seq.row, c] != 0:
                    self._drop(int(table[seq.row, c]))
                    table[seq.row, c] = 0
                    self.num_nulled += 1

    @torch.inference_mode()
    def step(self, scheduled: dict[int, int]) -> None:
        """One step: ``scheduled`` seq_id -> tokens to compute (1: a decode). A sequence
        whose computed tokens reach its length samples greedily."""
        order = sorted(scheduled, key=lambda sid: scheduled[sid] != 1)  # decodes first
        tokens, positions, slots = [], [], [[] for _ in self.groups]
        decode_rows, decode_ctx, prefills = [], [], []
        for sid in order:
            seq, n = self.seqs[sid], scheduled[sid]
            self._prepare(seq, n)
            span = range(seq.computed, seq.computed + n)
            tokens += seq.tokens[seq.computed : seq.computed + n]
            positions += span
            for g in range(len(self.groups)):
                slots[g] += [seq.blocks[g][p // self.bs] * self.bs + p % self.bs for p in span]
            if n == 1:
                decode_rows.append(seq.row)
                decode_ctx.append(seq.computed + 1)
            else:
                prefills.append((seq.row, seq.computed, n))
        mds = {key: self.attention.build_metadata(self.tables[key[0]], torch.tensor(slots[key[0]]), decode_rows, decode_ctx, prefills, key[1])
               for key in set(self.layer_keys)}
        hidden = self.model.forward(
            torch.tensor(tokens),
            torch.tensor(positions),
            self.attention.for_step([mds[k] for k in self.layer_keys]),
        )
        end = 0
        for sid in order:
            seq = self.seqs[sid]
            seq.computed += scheduled[sid]
            end += scheduled[sid]
            if seq.computed == len(seq.tokens):
                logits = self.model.compute_logits(hidden[end - 1 : end])[0]
                seq.logits.append((seq.computed - 1, logits))
                seq.tokens.append(int(logits.argmax()))
                seq.out.append(seq.tokens[-1])
