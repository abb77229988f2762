"""The engines of the P/D fleet what-if (simulator/pd_fleet.py): each a real scheduler with
its P/D connector (a producer on a prefill engine, a consumer on a decode engine), the
workload's view for its pool, and when it next acts."""

from __future__ import annotations

import bisect
import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from protocol.kv_transfer_config import parse_kv_transfer_config
from scheduler.sched.pd_connector import PDConnector
from simulator.engine import EngineRun
from simulator.pd_transfer import PDTransferLink
from simulator.workload import Workload


def pd_connector(role: str, engine_id: str, block_size: int, group_windows: Sequence[int] = ()) -> PDConnector:
    """The scheduler's connector of a ``kv_producer`` or ``kv_consumer`` engine, as ``--kv-transfer-config`` gives it,
    for KV-cache groups of ``group_windows`` (SimConfig's: (): one full-attention group), as the server's
    (scheduler/engine/pd_setup.py): a producer lends every group's blocks, a consumer pulls every group's."""
    config = {"kv_connector": "KVPoolConnector", "kv_role": role, "engine_id": engine_id, "kv_load_failure_policy": "recompute"}
    return PDConnector(parse_kv_transfer_config(json.dumps(config)), block_size, group_windows=tuple(group_windows) or (0,))


class PoolWorkload(Workload):
    """One pool's view of the workload: its own specs (arrivals rewritten when handed to
    it; a prefill engine's output is 1 token) and each prompt, built once when sent."""

    def __init__(self, inner: Workload, prompts: dict, output_len: int | None = None):
        self.specs = [s if output_len is None else dataclasses.replace(s, output_len=output_len) for s in inner.specs]
        self.output_token_base = inner.output_token_base
        self.prompts = prompts  # shared by the pools: index -> (prompt, block hashes)

    def prompt(self, index: int, hasher):
        prompt, hashes = self.prompts[index]
        return list(prompt), list(hashes)  # NOTE: a Request appends to its own lists


@dataclass(eq=False)
class Engine:
    """One engine of a pool: its run, what reaches it (a heap of (time, kind, request)),
    its link (a decode engine's), and its counts."""

    run: EngineRun
    pool: str
    index: int  # in its pool
    link: PDTransferLink | None = None
    inbox: list = field(default_factory=list)
    blocked: bool = False  # nothing to schedule until something reaches it
    finish_times: list = field(default_factory=list)
    routed: int = 0
    routed_tokens: int = 0
    busy_ns: int = 0
    peak_running: int = 0

    def wake(self) -> float:
        """When it next acts (inf: not until something reaches it)."""
        run, times = self.run, []
        if self.inbox:
            times.append(self.inbox[0][0])
        if self.link is not None and (t := self.link.next_event_ns()) is not None:
            times.append(t)
        if run.sched.has_unfinished_requests() and not self.blocked:
            times.append(run.now)
        return max(run.now, min(times)) if times else math.inf

    def load(self, t: int) -> int:
        return self.routed - bisect.bisect_right(self.finish_times, t)
