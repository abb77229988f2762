"""Just enough of a scheduler to drive a ModelRunner with valid, varied plans: random
prefill chunkings, rows left out of a step, shuffled non-contiguous block ids, prefix
blocks written by one request and read by another, preemption by recompute and resume.
Records every sampled token and its logits."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from protocol.sampling_params import SamplingParams
from protocol.worker_messages import AppendedBlocks, RequestRow, RowSampling, StepPlan
from worker.step.runner import ModelRunner


@dataclass
class Req:
    prompt: list[int]
    max_tokens: int
    tokens: list[int]
    computed: int = 0
    blocks: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    logits: list[tuple[int, torch.Tensor]] = field(default_factory=list)  # (position, (V,))
    sampling: SamplingParams | None = None


class MiniScheduler:
    """Just enough of a scheduler to produce valid, varied plans."""

    def __init__(self, runner: ModelRunner, rng: random.Random, num_blocks: int, block_size: int):
        self.runner, self.rng, self.bs = runner, rng, block_size
        self.free = list(range(1, num_blocks))
        rng.shuffle(self.free)  # NOTE: shuffled: rows get non-contiguous, unordered block ids
        self.refs: dict[int, int] = {}
        self.live: dict[int, Req] = {}
        self.preempted: dict[int, Req] = {}
        self.done: dict[int, Req] = {}
        self.step_id = 0
        self.new_rows: list[RequestRow] = []
        self.resumed: list[RequestRow] = []
        self.finished: list[int] = []
        self.preempt: list[int] = []
        # What the random plans covered, for tests to assert on.
        self.num_chunked = self.num_shared = self.num_preempted = self.num_resumed = 0

    @staticmethod
    def _sampling(req: Req) -> RowSampling | None:
        return None if req.sampling is None else RowSampling(len(req.prompt), req.sampling)

    def _alloc(self, n: int) -> list[int]:
        ids = [self.free.pop() for _ in range(n)]
        for b in ids:
            self.refs[b] = 1
        return ids

    def _release(self, req: Req) -> None:
        for b in reversed(req.blocks):
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self.free.append(b)
        req.blocks = []

    def add(self, seq_id: int, prompt: list[int], max_tokens: int, share_from: int | None = None,
            sampling: SamplingParams | None = None) -> None:
        req = Req(list(prompt), max_tokens, list(prompt), sampling=sampling)
        if share_from is not None:
            # Reuse the donor's full, computed blocks: a prefix-cache hit.
            donor = self.live[share_from]
            k = min(donor.computed, len(prompt) - 1) // self.bs
            req.prompt[: k * self.bs] = donor.tokens[: k * self.bs]
            req.tokens = list(req.prompt)
            req.blocks = donor.blocks[:k]
            for b in req.blocks:
                self.refs[b] += 1
            self.num_shared += k > 0
            req.computed = k * self.bs
        self.live[seq_id] = req
        self.new_rows.append(RequestRow(seq_id, list(req.tokens), list(req.blocks), req.computed, self._sampling(req)))

    def step(self) -> None:
        sched: dict[int, int] = {}
        appended: list[AppendedBlocks] = []
        new_ids = {r.seq_id for r in self.new_rows + self.resumed}
        for sid, req in self.live.items():
            remaining = len(req.tokens) - req.computed
            n = self.rng.randint(1, remaining) if self.rng.random() < 0.85 else 0
            need = -(-(req.computed + n) // self.bs) - len(req.blocks)
            if need > 0:
                ids = self._alloc(need)
                req.blocks += ids
                if sid in new_ids:  # its row is still to be sent whole: put them there
                    row = next(r for r in self.new_rows + self.resumed if r.seq_id == sid)
                    row.block_ids += ids
                else:
                    appended.append(AppendedBlocks(sid, ids))
            if n != 1:
                sched[sid] = n
            self.num_chunked += 1 < n < remaining
        plan = StepPlan(
            self.step_id, sched, self.new_rows, self.resumed, appended, self.finished, self.preempt
        )
        out = self.runner.execute(plan)
        self.step_id += 1
        self.new_rows, self.resumed, self.finished, self.preempt = [], [], [], []
        for sid, req in self.live.items():
            req.computed += sched.get(sid, 1)
        for i, (sid, tok) in enumerate(zip(out.seq_ids, out.sampled_token_ids, strict=True)):
            req = self.live[sid]
            assert req.computed == len(req.tokens)
            req.logits.append((len(req.tokens) - 1, out.logits[i]))
            req.tokens.append(tok)
            req.out.append(tok)
            if len(req.out) == req.max_tokens:
                self.finished.append(sid)
                self._release(req)
                self.done[sid] = self.live.pop(sid)
        # Preempt by recompute now and then; resume a preempted request later.
        if self.live and self.rng.random() < 0.15:
            sid = self.rng.choice(list(self.live))
            if sid not in self.finished and self.live[sid].out:
                req = self.live.pop(sid)
                self._release(req)
                req.computed = 0
                self.preempt.append(sid)
                self.num_preempted += 1
                self.preempted[sid] = req
        elif self.preempted and self.rng.random() < 0.5:
            sid = self.rng.choice(list(self.preempted))
            req = self.preempted.pop(sid)
            self.live[sid] = req
            self.num_resumed += 1
            self.resumed.append(RequestRow(sid, list(req.tokens), [], 0, self._sampling(req)))

    def run(self, max_steps: int = 500) -> None:
        for _ in range(max_steps):
            if not (self.live or self.preempted or self.new_rows):
                return
            self.step()
        raise AssertionError("requests did not finish")
