"""Rank 0 of a tensor-parallel group: the one rank that talks to the scheduler.

It is the ordinary process loop (``worker.process``) plus the fan-out: every WorkerReady
it accepts and every StepPlan it decoded go to the other ranks (``worker.parallel.plan_fanout``)
before rank 0 acts on them, so all ranks apply the same plans in step order; the tokens
it sampled ride with the next plan. Whenever it heartbeats the scheduler it also
keeps the other ranks' broadcast alive. Its hello says ``rank 0, world_size N``.

A collective that fails (another rank died: ``GroupLost``) ends the serve loop: rank 0
tells the scheduler with ``WorkerExit``, so the scheduler treats the group as a lost
worker at once (its requests go back to the queue), and the process exits
``EXIT_GROUP_LOST`` for its supervisor to start the group again.
"""

from __future__ import annotations

import logging

import msgspec
import torch
import zmq

from protocol.worker_messages import (
    Heartbeat,
    StepPlan,
    StepResult,
    WorkerError,
    WorkerExit,
    WorkerHello,
    WorkerReady,
)
from worker.config import WorkerConfig
from worker.load.serving_model import ServingModel
from worker.metrics import WorkerMetrics
from worker.parallel.distributed import GroupLost
from worker.parallel.plan_fanout import Kind, PlanFanout
from worker.process import WorkerProcess
from worker.step.runner import ModelRunner

log = logging.getLogger("worker")

EXIT_GROUP_LOST = 5


class GroupLeader(WorkerProcess):
    def __init__(self, config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor], metrics: WorkerMetrics | None,
                 fanout: PlanFanout, host_caches: list[torch.Tensor] | None = None):
        super().__init__(config, serving, kv_caches, metrics, host_caches)
        self.fanout = fanout
        self._frame = b""
        self._last_tokens: list[int] = []  # sampled in the step before, not yet fanned out
        self._stopped = False

    def hello(self) -> WorkerHello:
        return msgspec.structs.replace(super().hello(), rank=0, world_size=self.fanout.group.world_size)

    def _recv(self, sock: zmq.Socket):
        frames = sock.recv_multipart()
        self._frame = frames[-1]
        return self.codec.decode(self._frame)

    def _send(self, sock: zmq.Socket, msg) -> None:
        if type(msg) is Heartbeat:
            self.fanout.send(Kind.KEEPALIVE)
        super()._send(sock, msg)

    def _install(self, ready: WorkerReady) -> str | None:
        refused = super()._install(ready)
        if refused is None:
            self._last_tokens = []
            self.fanout.send(Kind.READY, (), self._frame)
        return refused

    def _set_ready(self, runner: ModelRunner | None) -> None:
        if runner is None:
            # NOTE: also when no runner was set: a failed handshake (--reconnect) then
            # still reaches the other ranks, within their --distributed-timeout.
            self._last_tokens = []
            self.fanout.send(Kind.RESET)
        super()._set_ready(runner)

    def _execute(self, plan: StepPlan) -> StepResult | WorkerError:
        self.fanout.send(Kind.PLAN, self._last_tokens, self._frame)
        reply = super()._execute(plan)
        # NOTE: a refused plan changed no rank's state (each rank checks it the same way).
        self._last_tokens = _all_tokens(reply) if type(reply) is StepResult else []
        return reply

    def _serve(self, sock: zmq.Socket) -> int:
        try:
            code = super()._serve(sock)
        except GroupLost as e:
            log.error("tensor-parallel group lost: %s", e)
            # NOTE: linger, so the goodbye leaves before the socket closes.
            super()._send(sock, WorkerExit(f"tensor-parallel group lost: {e}"))
            sock.close(linger=1000)
            raise
        self.stop_group()
        return code

    def stop_group(self) -> None:
        """Tell the other ranks to exit 0, once (best effort: they may be gone already)."""
        if self._stopped:
            return
        self._stopped = True
        try:
            self.fanout.send(Kind.STOP)
        except GroupLost:
            pass


def _all_tokens(result: StepResult) -> list[int]:
    """The step's tokens row after row, a row's extra tokens (verified drafts) after its first:
    the other ranks divide them by the drafts they ran (ModelRunner.append_sampled)."""
    extra = result.extra_token_ids
    if not extra:
        return result.sampled_token_ids
    tokens = []
    for sid, tok in zip(result.seq_ids, result.sampled_token_ids, strict=True):
        tokens.append(tok)
        tokens.extend(extra.get(sid, ()))
    return tokens
