"""A tensor-parallel rank other than 0: it never talks to the scheduler.

It does what rank 0 fans out (``worker.parallel.plan_fanout``), in order: builds its runner from
the WorkerReady rank 0 accepted, and for each plan first appends the tokens rank 0
sampled in the step before, then checks, applies and runs the plan on its shard (its
all-reduces meet rank 0's) without sampling. A plan rank 0 refuses is refused here the
same way (the same check over the same state), so no rank's rows change.

Exits 0 on STOP; ``GroupLost`` (rank 0 died, or stopped broadcasting for longer than
``--distributed-timeout``) propagates to ``run_rank`` (``worker.parallel.rank_group``).
"""

from __future__ import annotations

import logging

import torch

from protocol.codec import Codec
from protocol.kv_cache_spec import KVCacheGroupSpec
from protocol.worker_messages import SchedulerToWorker, SpecStepPlan, StepPlan, WorkerReady
from worker.attention.kv_quant import KVScales
from worker.kv.kv_cache import first_blocks
from worker.models.decoder import DecoderModel
from worker.parallel.distributed import GroupLost
from worker.parallel.plan_fanout import Kind, PlanFanout
from worker.step.plan_check import PlanError
from worker.step.runner import ModelRunner

log = logging.getLogger("worker")


class RankFollower:
    def __init__(self, model: DecoderModel, kv_caches: list[torch.Tensor], fanout: PlanFanout,
                 host_caches: list[torch.Tensor] | None = None, kv_scales: list[KVScales] | None = None,
                 groups: list[KVCacheGroupSpec] | None = None, layer_windows: tuple[int, ...] | None = None):
        self.model = model
        # The KV-cache groups and each layer's window (None: one full-attention group), as rank 0's.
        self.groups, self.layer_windows = groups, layer_windows
        self.kv_scales = kv_scales  # per layer, for an fp8 cache
        self.kv_caches = kv_caches  # each (2, num_blocks, block_size, local kv heads, head_dim)
        self.host_caches = host_caches  # the offload tier of this rank's heads, or None
        self.fanout = fanout
        self.codec: Codec = Codec(SchedulerToWorker)
        self.runner: ModelRunner | None = None
        self._waiting: list[int] = []  # rows that reached their last token in the step before
        self._drafts: dict[int, list[int]] = {}  # the drafts those rows verified (speculative decoding)
        self.num_steps = 0

    def run(self) -> int:
        rank = self.fanout.group.rank
        while True:
            kind, tokens, frame = self.fanout.recv()
            match kind:
                case Kind.KEEPALIVE:
                    pass
                case Kind.PLAN:
                    self._step(tokens, frame)
                case Kind.READY:
                    self._install(self.codec.decode(frame))
                case Kind.RESET:
                    self.runner, self._waiting = None, []
                case Kind.STOP:
                    log.info("rank %d: the group stops", rank)
                    return 0

    def _install(self, ready: WorkerReady) -> None:
        caches = first_blocks(self.kv_caches, ready.num_blocks)
        hosts = None
        if self.host_caches is not None and ready.num_host_blocks > 0:
            hosts = [h[:, : ready.num_host_blocks] for h in self.host_caches]
        self.runner = ModelRunner(self.model, caches, ready.max_num_seqs, ready.max_model_len, ready.next_step_id,
                                  host_caches=hosts, kv_scales=self.kv_scales, groups=self.groups, layer_windows=self.layer_windows)
        self.runner.samples = False
        self._waiting = []
        log.info("rank %d ready: %d blocks, next step %d", self.fanout.group.rank, ready.num_blocks, ready.next_step_id)

    def _step(self, tokens: list[int], frame: bytes) -> None:
        runner = self.runner
        if runner is None:
            raise GroupLost(f"rank {self.fanout.group.rank}: a plan before WorkerReady")
        try:
            runner.append_sampled(self._waiting, tokens, self._drafts)
        except ValueError as e:
            raise GroupLost(f"rank {self.fanout.group.rank}: rank 0's sampled tokens do not fit this rank's rows: {e}") from None
        self._waiting, self._drafts = [], {}
        plan = self.codec.decode(frame)
        if type(plan) not in (StepPlan, SpecStepPlan):
            raise GroupLost(f"rank {self.fanout.group.rank}: rank 0 fanned out a {type(plan).__name__} as a plan")
        try:
            out = runner.execute(plan)
        except PlanError:
            return
        self._waiting, self._drafts = out.seq_ids, plan.spec_token_ids
        self.num_steps += 1
