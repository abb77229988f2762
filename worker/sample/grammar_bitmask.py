"""The token bitmask of the rows that have a grammar: xgrammar's matchers, one per
table row, on the worker that samples (rank 0).

As vLLM's ``StructuredOutputManager.grammar_bitmask`` + ``apply_grammar_bitmask``:
before sampling, each sampled row with a grammar fills its row of one bitmask tensor
(allocated once, (max_num_seqs, ceil(V / 32)) int32), and one batched
``apply_token_bitmask_inplace`` sets every disallowed logit to -inf -- greedy rows
too, and before penalties, temperature and logprobs, as vLLM applies it to the
model's logits before its sampler. After sampling each matcher accepts its token. A
terminated matcher (it accepted a stop token) masks nothing, as vLLM's full mask:
its request stops on that token anyway. Rows without a grammar are never touched.

A row sent whole again (resumed after preemption or a lost worker) gets a fresh
matcher that accepts the row's output tokens first, so it continues where it was.
"""

from __future__ import annotations

import logging

import torch

from protocol.structured_output import RowGrammar
from worker.sample.grammar_compiler import GrammarCompiler, load_xgrammar

log = logging.getLogger("worker")

# The logits dtypes xgrammar's kernels take; others (float64, a test dtype) go through torch.
_XGRAMMAR_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BITS = torch.arange(32, dtype=torch.int32)


def _apply_bitmask_torch(logits: torch.Tensor, mask: torch.Tensor, at: list[int], vocab_size: int) -> None:
    """What apply_token_bitmask_inplace does, for any dtype: bit j of word w allows token 32w + j."""
    idx = torch.tensor(at, dtype=torch.long, device=logits.device)
    bits = (mask[idx].unsqueeze(-1) >> _BITS.to(mask.device)) & 1  # (n, W, 32)
    allowed = bits.flatten(1)[:, :vocab_size].bool()  # (n, V)
    logits[idx, :vocab_size] = logits[idx, :vocab_size].masked_fill(~allowed, float("-inf"))


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler, max_num_seqs: int, vocab_size: int):
        self.compiler = compiler
        self.max_num_seqs, self.vocab_size = max_num_seqs, vocab_size
        self.matchers: dict[int, object] = {}  # table row -> xgrammar.GrammarMatcher
        self._bitmask: torch.Tensor | None = None  # (max_num_seqs, ceil(V / 32)) int32, CPU

    def add(self, row: int, grammar: RowGrammar, output_token_ids: list[int]) -> None:
        xgr = load_xgrammar()
        compiled = self.compiler.compiled(grammar.spec)
        matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=list(grammar.stop_token_ids) or None)
        for tok in output_token_ids:
            if matcher.is_terminated() or not matcher.accept_token(tok):
                break
        self.matchers[row] = matcher

    def remove(self, row: int) -> None:
        self.matchers.pop(row, None)

    def any_of(self, rows: list[int]) -> bool:
        return bool(self.matchers) and any(r in self.matchers for r in rows)

    def apply(self, logits: torch.Tensor, rows: list[int]) -> None:
        """logits (N, V), row i of table row ``rows[i]``: mask, in place, every token
        the grammar of a row that has one does not allow next."""
        xgr = load_xgrammar()
        if self._bitmask is None:
            self._bitmask = xgr.allocate_token_bitmask(self.max_num_seqs, self.vocab_size)
        bitmask = self._bitmask
        at = []
        for i, row in enumerate(rows):
            matcher = self.matchers.get(row)
            if matcher is None:
                continue
            if matcher.is_terminated():
                bitmask[i].fill_(-1)
            else:
                matcher.fill_next_token_bitmask(bitmask, i)
            at.append(i)
        mask = bitmask[: len(rows)].to(logits.device, non_blocking=True)  # (N, ceil(V / 32))
        if logits.dtype in _XGRAMMAR_DTYPES:
            xgr.apply_token_bitmask_inplace(logits, mask, vocab_size=self.vocab_size, indices=at)
        else:
            _apply_bitmask_torch(logits, mask, at, self.vocab_size)

    def accept(self, rows: list[int], token_ids: list[int]) -> None:
        """Each row with a grammar advances by its sampled token."""
        for row, tok in zip(rows, token_ids, strict=True):
            matcher = self.matchers.get(row)
            if matcher is not None and not matcher.is_terminated() and not matcher.accept_token(tok):
                log.error("grammar matcher of table row %d refused sampled token %d", row, tok)
