"""The step runner: apply a plan's deltas, run the model over the scheduled tokens
through the paged cache, and sample.

For each live request the runner keeps its tokens (from its RequestRow plus what it
sampled) and how many of them have K/V in the cache. Scheduled tokens of a row are
``token_ids[computed : computed + n]`` at those positions; after the step
``computed += n``, and a row whose computed tokens reach its token count samples one
token with its SamplingParams (``worker.sample.sampling_state``; a row still mid-prefill
samples nothing).

Speculative decoding: a row the plan gives drafts (``spec_token_ids``) runs its last token
and the drafts as one chunk and samples at every position, in order, each with the row's
sampling parameters and grammar as if it were a decode step of its own (its output so far
includes the drafts accepted before it): a draft is accepted while the token sampled at
the position before it equals it. For greedy rows that is vLLM's exact-match rule; for
sampled rows it is vLLM's rejection sampling of a draft that is certain (n-gram drafts
carry no probabilities): the draft is kept with probability p(draft), else a token is
drawn from p without it -- together a draw from p, so the output keeps the target
distribution, and a seeded row draws exactly the tokens it would without drafts.

KV-cache groups: ``kv_caches`` has one entry per layer (a hybrid model's layers of
different groups may share a tensor), and ``worker.step.group_tables`` keeps a table per
group: one for most models, the runner's own ``block_table``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.prompt_logprobs import PromptLogprobs
from protocol.worker_messages import RequestRow, StepPlan
from worker.attention.kv_quant import KVScales
from worker.attention.paged_attention import DEFAULT_WORKSPACE_BYTES, PagedAttention
from worker.cpu.threads import StepThreads
from worker.kv.tier_copies import TierCopier
from worker.models.decoder import DecoderModel
from worker.sample.grammar_bitmask import GrammarRows
from worker.sample.grammar_compiler import GrammarCompiler
from worker.sample.prompt_logprobs import PromptChunk, PromptLogprobsState
from worker.sample.sampling_state import RowLogprobs, SamplingState
from worker.step import fused_step
from worker.step.block_table import BlockTable
from worker.step.group_tables import GroupTables, hello_group_windows
from worker.step.plan_check import check_plan
from worker.step.plan_limits import Limits, RowView
from worker.step.step_inputs import StepInputs


@dataclass(slots=True)
class RowState:
    token_ids: list[int]
    num_computed_tokens: int
    num_prompt_tokens: int


@dataclass(slots=True)
class ModelRunnerOutput:
    seq_ids: list[int]
    sampled_token_ids: list[int]
    logits: torch.Tensor | None  # (len(seq_ids), V), row i for seq_ids[i]
    num_scheduled_tokens: int
    logprobs: list[RowLogprobs | None] | None = None  # per seq_ids[i], when asked
    prompt_logprobs: dict[int, PromptLogprobs] | None = None  # seq_id -> its prompt's, when asked
    # Speculative decoding: seq_id -> its tokens after sampled_token_ids' (accepted drafts, then one
    # more), and their logprobs when asked; only rows that got more than one token.
    extra_token_ids: dict[int, list[int]] | None = None
    extra_logprobs: dict[int, list[RowLogprobs | None]] | None = None




class ModelRunner:
    def __init__(
        self,
        model: DecoderModel,
        kv_caches: list[torch.Tensor],
        max_num_seqs: int,
        max_model_len: int,
        next_step_id: int = 0,
        workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
        seed: int = 0,
        host_caches: list[torch.Tensor] | None = None,
        grammar_compiler: GrammarCompiler | None = None,
        kv_scales: list[KVScales] | None = None,
        groups: Sequence[KVCacheGroupSpec] | None = None,
        layer_windows: Sequence[int] | None = None,
        step_threads: StepThreads | None = None,
    ):
        """kv_caches: one entry per layer (layers of different KV-cache groups may share a
        tensor). groups: the KV-cache groups (None: one full-attention group of every
        layer); layer_windows: each layer's attention window, 0 full (None: its group's).
        step_threads: the forward's CPU threads per step (None: torch's count throughout)."""
        self.model = model
        self.step_threads = step_threads or StepThreads(None, 0)
        _, num_blocks, block_size, kvh, hd = kv_caches[0].shape
        self.block_size = block_size
        self.device = kv_caches[0].device
        max_blocks_per_seq = -(-max_model_len // block_size)
        self.limits = Limits(
            num_blocks=num_blocks,
            block_size=block_size,
            max_num_seqs=max_num_seqs,
            max_blocks_per_seq=max_blocks_per_seq,
            max_model_len=max_model_len,
            vocab_size=model.config.vocab_size,
            num_host_blocks=0 if not host_caches else host_caches[0].shape[1],
            group_windows=() if groups is None else tuple(hello_group_windows(groups)),
        )
        # The offload tier's copies (plan.tier_copies), when this worker has a host tier.
        self.tier = TierCopier(kv_caches, host_caches) if host_caches else None
        self.block_table = BlockTable(max_num_seqs, max_blocks_per_seq, block_size, self.device)
        if groups is None:
            groups = [KVCacheGroupSpec(list(range(len(kv_caches))))]
        windows = layer_windows
        if windows is None:
            windows = [0] * len(kv_caches)
            for g in groups:
                for layer in g.layer_ids:
                    windows[layer] = g.sliding_window
        # Every group's table (group 0's: block_table) and each layer's attention metadata.
        self.groups = GroupTables(groups, windows, self.block_table)
        self.attention = PagedAttention(kv_caches, model.num_heads, max_blocks_per_seq, workspace_bytes,
                                        compute_dtype=model.dtype, kv_scales=kv_scales, scale=model.config.attention_scale)
        # A step's layers in one native call, where this model and cache allow it (worker/step/fused_step.py).
        self.fused = fused_step.for_model(model, self.attention)
        self.sampling = SamplingState(max_num_seqs, model.config.vocab_size, self.device, seed)
        # Structured outputs, where tokens are sampled (None on other TP ranks: they ignore grammars).
        self.grammars = None if grammar_compiler is None else GrammarRows(grammar_compiler, max_num_seqs, model.config.vocab_size)
        self.prompt_logprobs = PromptLogprobsState()
        self.rows: dict[int, RowState] = {}
        # NOTE: False on tensor-parallel ranks other than 0: they run the model, rank 0
        # samples, and its tokens reach them through append_sampled before the next plan.
        self.samples = True
        self.next_step_id = next_step_id
        # Counters for the process loop to export; never reset.
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.kv_bytes_written = 0
        self._kv_bytes_per_token = 2 * len(kv_caches) * kvh * hd * kv_caches[0].element_size()

    def _row_view(self, seq_id: int) -> RowView:
        st = self.rows[seq_id]
        return (len(st.token_ids), st.num_computed_tokens, self.block_table.num_blocks(seq_id))

    def _add(self, row: RequestRow) -> None:
        table_row = self.block_table.add_row(row.seq_id, row.block_ids)
        n, sampling = len(row.token_ids), row.sampling
        # NOTE: a row without sampling parameters never reads its prompt length.
        num_prompt = n if sampling is None else min(sampling.num_prompt_tokens, n)
        self.rows[row.seq_id] = RowState(list(row.token_ids), row.num_computed_tokens, num_prompt)
        self.sampling.add(table_row, None if sampling is None else sampling.params, row.token_ids, num_prompt)
        if sampling is not None and sampling.grammar is not None and self.grammars is not None:
            self.grammars.add(table_row, sampling.grammar, row.token_ids[num_prompt:])
        if sampling is not None:
            self.prompt_logprobs.add(row.seq_id, sampling.params.prompt_logprobs, row.token_ids, num_prompt)

    def _remove(self, seq_id: int) -> None:
        self.prompt_logprobs.remove(seq_id)
        self.sampling.remove(self.block_table.row_of[seq_id])
        if self.grammars is not None:
            self.grammars.remove(self.block_table.row_of[seq_id])
        self.block_table.remove_row(seq_id)
        del self.rows[seq_id]

    def apply(self, plan: StepPlan) -> None:
        """The plan's row deltas, in rule-3 order. Only after ``check_plan`` passed."""
        for sid in plan.finished_seq_ids:
            self._remove(sid)
        for sid in plan.preempted_seq_ids:
            self._remove(sid)
        for row in plan.new_rows:
            self._add(row)
        for row in plan.resumed_rows:
            if row.seq_id in self.rows:
                self._remove(row.seq_id)
            self._add(row)
        self.groups.apply(plan)

    def append_sampled(self, seq_ids: list[int], token_ids: list[int], spec: dict[int, list[int]] | None = None) -> None:
        """The tokens rank 0 sampled for ``seq_ids`` (what an execute with ``samples`` False returned),
        row after row. A row with drafts in that step (``spec``) has a token for each draft accepted
        and one more: the tokens are read while each equals its draft, and the row's computed
        tokens grow by the drafts accepted. Raises ValueError if the tokens do not divide so."""
        it = iter(token_ids)
        try:
            for sid in seq_ids:
                st = self.rows[sid]
                tok = next(it)
                st.token_ids.append(tok)
                drafts = spec.get(sid) if spec else None
                if drafts is None:
                    continue
                for draft in drafts:
                    if tok != draft:
                        break
                    st.num_computed_tokens += 1  # accepted: its K/V, written this step, stand
                    tok = next(it)
                    st.token_ids.append(tok)
        except StopIteration:
            raise ValueError(f"{len(token_ids)} tokens are fewer than the rows {seq_ids} and their accepted drafts need") from None
        if next(it, None) is not None:
            raise ValueError(f"{len(token_ids)} tokens are more than the rows {seq_ids} and their accepted drafts need")

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> ModelRunnerOutput:
        """Check, apply and run one plan. Raises PlanError (state unchanged) if the
        plan breaks the contract."""
        check_plan(plan, self.next_step_id, self.rows.keys(), self._row_view, self.limits, self.groups)
        self.apply(plan)
        self.next_step_id += 1
        self.num_steps += 1
        if plan.tier_copies is not None:
            # Stores then loads, before any token of the step is written or attended.
            self.tier.copy(plan.tier_copies)
            try:
                return self._forward(plan)
            finally:
                self.tier.finish()
        return self._forward(plan)

    def _forward(self, plan: StepPlan) -> ModelRunnerOutput:
        inputs = self._prepare_inputs(plan)
        num_tokens = len(inputs.token_ids)
        if num_tokens == 0:
            return ModelRunnerOutput([], [], None, 0)
        dev = self.device
        token_ids = torch.tensor(inputs.token_ids, dtype=torch.long, device=dev)  # (T,)
        positions = torch.tensor(inputs.positions, dtype=torch.long, device=dev)  # (T,)
        rows = torch.tensor(inputs.rows, dtype=torch.long, device=dev)  # (T,)
        metadata = self.groups.step_metadata(self.attention, rows, positions, inputs)
        with self.step_threads.step(num_tokens):
            hidden = None if self.fused is None else self.fused.forward(token_ids, positions, metadata)  # None: not a step it runs
            if hidden is None:
                hidden = self.model.forward(token_ids, positions, self.attention.for_step(metadata))  # (T, H)
        # NOTE: only rank 0 samples, so only it scores prompts (tensor parallelism).
        scored = self._prompt_logprobs(hidden, inputs) if self.prompt_logprobs.pending and self.samples else None
        sample_seq, sample_idx, spec = self._advance(inputs)
        self.num_tokens_computed += num_tokens
        self.kv_bytes_written += num_tokens * self._kv_bytes_per_token
        if not sample_seq:
            return ModelRunnerOutput([], [], None, num_tokens, prompt_logprobs=scored)
        if not self.samples:
            return ModelRunnerOutput(sample_seq, [], None, num_tokens)
        out = self._sample(hidden, sample_seq, sample_idx, num_tokens, spec)
        if scored is not None:
            out.prompt_logprobs = self.prompt_logprobs.finish(scored, sample_seq)
        return out

    def _prompt_logprobs(self, hidden: torch.Tensor, inputs: StepInputs) -> dict[int, PromptLogprobs]:
        """hidden (T, H): what this step's tokens of pending rows score of their prompts
        (before ``_advance``: computed counts are the step's start), by seq_id."""
        pending, rows = self.prompt_logprobs.pending, self.rows
        chunks = [PromptChunk(sid, i, rows[sid].num_computed_tokens, 1)
                  for i, sid in enumerate(inputs.decode_seq_ids) if sid in pending]
        offset = len(inputs.decode_seq_ids)
        for sid, (_, c, n) in zip(inputs.prefill_seq_ids, inputs.prefills, strict=True):
            if sid in pending:
                chunks.append(PromptChunk(sid, offset, c, n))
            offset += n
        return self.prompt_logprobs.compute(self.model.compute_logits, hidden, chunks, lambda sid: rows[sid].token_ids) if chunks else {}

    def _prepare_inputs(self, plan: StepPlan) -> StepInputs:
        """The step's tokens laid out decodes (one token) first, then prefill chunks:
        see worker.attention.paged_attention."""
        scheduled = plan.num_scheduled_tokens
        spec = plan.spec_token_ids
        row_of = self.block_table.row_of
        dec_seq, dec_rows, dec_tokens, dec_pos = [], [], [], []
        pre_seq, pre_chunks, pre_tokens, pre_pos, pre_rows = [], [], [], [], []
        for sid, st in self.rows.items():
            n = scheduled.get(sid, 1)
            c = st.num_computed_tokens
            if n == 1:
                dec_seq.append(sid)
                dec_rows.append(row_of[sid])
                dec_tokens.append(st.token_ids[c])
                dec_pos.append(c)
            elif n > 1:
                pre_seq.append(sid)
                pre_chunks.append((row_of[sid], c, n))
                if spec and sid in spec:
                    pre_tokens.append(st.token_ids[c])  # its last token, then the drafts
                    pre_tokens.extend(spec[sid])
                else:
                    pre_tokens.extend(st.token_ids[c : c + n])
                pre_pos.extend(range(c, c + n))
                pre_rows.extend([row_of[sid]] * n)
        return StepInputs(
            dec_seq, pre_seq, dec_rows, [p + 1 for p in dec_pos], pre_chunks,
            dec_tokens + pre_tokens, dec_pos + pre_pos, dec_rows + pre_rows, spec,
        )

    def _advance(self, inputs: StepInputs) -> tuple[list[int], list[int], list[tuple[int, int, list[int]]]]:
        """Advance computed counts; the rows that reach their token count sample: their
        seq ids, and the index of each one's last token among the step's. A row with
        drafts counts only its last token as computed here (its drafts count as they are
        accepted, in ``_sample``) and samples from that token on: the third list holds
        those rows as (seq_id, index of its last token among the step's, its drafts)."""
        sample_seq, sample_idx, spec_rows = [], [], []
        drafts = inputs.drafts
        for i, sid in enumerate(inputs.decode_seq_ids):
            st = self.rows[sid]
            st.num_computed_tokens += 1
            if st.num_computed_tokens == len(st.token_ids):
                sample_seq.append(sid)
                sample_idx.append(i)
        offset = len(inputs.decode_seq_ids)
        for sid, (_, _, n) in zip(inputs.prefill_seq_ids, inputs.prefills, strict=True):
            st = self.rows[sid]
            offset += n
            if drafts and sid in drafts:
                st.num_computed_tokens += 1
                sample_seq.append(sid)
                sample_idx.append(offset - n)
                spec_rows.append((sid, offset - n, drafts[sid]))
                continue
            st.num_computed_tokens += n
            if st.num_computed_tokens == len(st.token_ids):
                sample_seq.append(sid)
                sample_idx.append(offset - 1)
        return sample_seq, sample_idx, spec_rows

    def _sample(self, hidden: torch.Tensor, sample_seq: list[int], sample_idx: list[int], num_tokens: int,
                spec: list[tuple[int, int, list[int]]] | None = None) -> ModelRunnerOutput:
        """hidden (T, H): one token for each row of ``sample_seq`` from its hidden state
        at ``sample_idx``, appended to the row; rows with drafts (``spec``) then verify them."""
        n = len(sample_seq)
        if spec:
            # Every draft position's logits too, in the same pass over the LM head (its weights
            # are read once a step whatever the rows; the positions a rejection leaves are wasted).
            sample_idx = sample_idx + [start + j for _, start, drafts in spec for j in range(1, len(drafts) + 1)]
        idx = torch.tensor(sample_idx, dtype=torch.long, device=self.device)
        all_logits = self.model.compute_logits(hidden[idx])  # (N + drafts, V)
        logits = all_logits[:n] if spec else all_logits
        sampled, logprobs = self._sample_rows(logits, sample_seq)
        out = ModelRunnerOutput(sample_seq, sampled, logits, num_tokens, logprobs)
        if spec:
            self._verify(all_logits, sample_seq, sampled, spec, out)
        return out

    def _sample_rows(self, logits: torch.Tensor, seq_ids: list[int]) -> tuple[list[int], list[RowLogprobs | None]]:
        """logits (N, V), row i of ``seq_ids[i]``: each row's next token (grammar, then its
        sampling parameters over its output so far), appended to the row."""
        rows, row_of = self.rows, self.block_table.row_of
        table_rows = [row_of[sid] for sid in seq_ids]
        num_outputs = [len(rows[sid].token_ids) - rows[sid].num_prompt_tokens for sid in seq_ids]
        grammars = self.grammars
        if grammars is not None and grammars.any_of(table_rows):
            grammars.apply(logits, table_rows)  # in place, before any sampling step (as vLLM)
        sampled, logprobs = self.sampling.sample(logits, table_rows, num_outputs, lambda i: rows[seq_ids[i]].token_ids)
        if grammars is not None and grammars.matchers:
            grammars.accept(table_rows, sampled)
        for sid, tok in zip(seq_ids, sampled, strict=True):
            rows[sid].token_ids.append(tok)
        return sampled, logprobs

    def _verify(self, all_logits: torch.Tensor, sample_seq: list[int], sampled: list[int],
                spec: list[tuple[int, int, list[int]]], out: ModelRunnerOutput) -> None:
        """The drafts of ``spec``'s rows, position after position: a row goes on while the
        token it sampled equals its draft there (accepted: that position's K/V stand), and
        samples again from the logits after it (``all_logits`` rows from len(sample_seq) on,
        each row's draft positions in order); its last token is the first that differs, or
        the one after its last draft. Fills ``out``'s extra tokens (and their logprobs)."""
        rows = self.rows
        first = dict(zip(sample_seq, sampled, strict=True))
        alive = []  # (seq_id, where its draft positions' logits start, its drafts)
        base = len(sample_seq)
        for sid, _, drafts in spec:
            if first[sid] == drafts[0]:
                alive.append((sid, base, drafts))
            base += len(drafts)
        extra_tokens: dict[int, list[int]] = {}
        extra_logprobs: dict[int, list[RowLogprobs | None]] = {}
        j = 1
        while alive:
            seq_ids = [sid for sid, _, _ in alive]
            for sid in seq_ids:
                rows[sid].num_computed_tokens += 1  # draft j - 1 was accepted
            at = torch.tensor([b + j - 1 for _, b, _ in alive], dtype=torch.long, device=all_logits.device)
            tokens, logprobs = self._sample_rows(all_logits[at], seq_ids)
            still = []
            for (sid, b, drafts), tok, lp in zip(alive, tokens, logprobs, strict=True):
                extra_tokens.setdefault(sid, []).append(tok)
                extra_logprobs.setdefault(sid, []).append(lp)
                if j < len(drafts) and tok == drafts[j]:
                    still.append((sid, b, drafts))
            alive = still
            j += 1
        out.extra_token_ids = extra_tokens
        out.extra_logprobs = extra_logprobs
