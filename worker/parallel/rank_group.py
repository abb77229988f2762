"""Starting a tensor-parallel group on one host, and running one rank of it.

``python -m worker --tensor-parallel-size N`` without ``--rank`` is rank 0 of a group
on this host: it starts ranks 1..N-1 itself (the same command line plus ``--rank i``,
``--distributed-init-method`` on the free loopback port its store already listens on,
no /metrics), each with ``PR_SET_PDEATHSIG`` so none outlives it, and an equal share of
the CPU threads. When
rank 0 exits it stops them (they have normally exited already: STOP, or their
collective failed). A supervisor (``kvpool serve``) therefore restarts the whole group
by restarting rank 0. With ``--rank`` each rank is started by hand (several hosts),
all with the same ``--distributed-init-method``: rank 0's address.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import time

import torch
import zmq

from worker.config import WorkerConfig
from worker.load.serving_model import ServingModel
from worker.metrics import WorkerMetrics
from worker.parallel.distributed import GroupLost, TPGroup
from worker.parallel.group_leader import EXIT_GROUP_LOST, GroupLeader
from worker.parallel.plan_fanout import PlanFanout
from worker.parallel.rank_follower import RankFollower

log = logging.getLogger("worker")

PR_SET_PDEATHSIG = 1
STOP_TIMEOUT_S = 5.0


def _die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


def rank_device(device: str, rank: int) -> torch.device:
    """On CUDA each rank its own device (NCCL refuses two ranks on one): rank modulo
    the devices this host has; on CPU the CPU."""
    if device != "cuda":
        return torch.device(device)
    d = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(d)
    return d


def threads_per_rank(world_size: int) -> int:
    """This host's share of torch threads for each of ``world_size`` local ranks."""
    return max(1, torch.get_num_threads() // world_size)


class LocalRanks:
    """Ranks 1..N-1 started by rank 0 on this host."""

    def __init__(self, argv: list[str], world_size: int, init_method: str, num_threads: int):
        self.procs: list[subprocess.Popen] = []
        env = dict(os.environ, OMP_NUM_THREADS=str(num_threads))
        for rank in range(1, world_size):
            cmd = [sys.executable, "-m", "worker", *argv, "--rank", str(rank), "--distributed-init-method", init_method,
                   "--http-port", "0"]
            self.procs.append(subprocess.Popen(cmd, env=env, preexec_fn=_die_with_parent))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def stop(self) -> None:
        """Bounded: wait for them to exit on their own, then SIGTERM, then SIGKILL."""
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for sig in (None, signal.SIGTERM, signal.SIGKILL):
            for p in self.procs:
                if p.poll() is None and sig is not None:
                    p.send_signal(sig)
            for p in self.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(max(0.1, deadline - time.monotonic()))
            if all(p.poll() is not None for p in self.procs):
                return
            deadline = time.monotonic() + STOP_TIMEOUT_S


def run_rank(config: WorkerConfig, serving: ServingModel, kv_caches: list[torch.Tensor], metrics: WorkerMetrics | None,
             group: TPGroup, ctx: zmq.Context, host_caches: list[torch.Tensor] | None = None) -> int:
    """Serve as this rank until the group stops; EXIT_GROUP_LOST if another rank died."""
    fanout = PlanFanout(group)
    try:
        if group.rank == 0:
            leader = GroupLeader(config, serving, kv_caches, metrics, fanout, host_caches)
            try:
                return leader.run(ctx)
            finally:
                leader.stop_group()  # SIGTERM, refusal, scheduler lost: the others stop too
        return RankFollower(serving.model, kv_caches, fanout, host_caches, list(serving.kv_scales),
                            list(serving.kv_cache_groups) or None, serving.layer_windows or None).run()
    except GroupLost as e:
        log.error("rank %d: the tensor-parallel group is lost (%s); exiting %d", group.rank, e, EXIT_GROUP_LOST)
        return EXIT_GROUP_LOST
