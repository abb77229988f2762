"""PDConnector: the scheduler's side of P/D disaggregation (``--kv-transfer-config``).

vLLM's KV connector, scheduler role, for prefill and decode on separate engines
(its NixlConnector's contract, behind vllm-router's PD mode; docs/pd-disaggregation.md):

* **A decode engine pulls.** A request whose ``kv_transfer_params`` say
  ``do_remote_prefill`` has its prompt's KV in a prefill engine's worker. After the
  device's own hits, the rest of the prompt is counted as external tokens
  (`num_remote_tokens`, vLLM's ``get_num_new_matched_tokens``), the blocks are
  allocated, and the request is parked while its worker reads them (`add_pull`; the
  parking is scheduler/sched/external_wait.py's). Once read, they are cached like
  computed blocks: hits for later requests.
* **A prefill engine lends.** A request that says ``do_remote_decode`` and ends normally
  keeps its blocks (one more owner, as a pin is): `lend` records it, the plan tells the
  worker which blocks a decode engine may read, and the answer's params say where. The
  blocks are freed when the worker reports the read (`sent`) or when the lease passes
  (`expired`, vLLM's ``kv_lease_duration``), whichever is first.

It holds what the scheduler has to remember, and builds the plan's ``KVTransferOps``;
it moves no byte (the workers do: worker/transfer/).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from protocol.kv_transfer_config import KVTransferConfig
from protocol.worker_messages import KVTransferOps
from scheduler.core.kv_cache_block import KVCacheBlock
from scheduler.sched.pd_remote_blocks import RemoteSpan, lent_block_ids, pull_lists, remote_span
from scheduler.sched.request import Request

log = logging.getLogger("scheduler")


@dataclass(slots=True)
class _Ops:
    lend_ids: list[str] = field(default_factory=list)
    lend_block_ids: list[list[list[int]]] = field(default_factory=list)
    unlend_ids: list[str] = field(default_factory=list)
    pull_ids: list[int] = field(default_factory=list)
    pull_addresses: list[str] = field(default_factory=list)
    pull_request_ids: list[str] = field(default_factory=list)
    pull_remote_block_ids: list[list[list[int]]] = field(default_factory=list)
    pull_block_ids: list[list[int]] = field(default_factory=list)


class PDConnector:
    """The connector of ``config`` for blocks of ``block_size`` tokens, KV-cache groups of
    windows ``group_windows`` (0: full attention; (0,): one full-attention group)."""

    def __init__(self, config: KVTransferConfig, block_size: int, clock: Callable[[], float] = time.monotonic,
                 group_windows: Sequence[int] = (0,)):
        self.config = config
        self.block_size = block_size
        self.group_windows = list(group_windows)
        # What a lease is timed by (a simulator passes its virtual clock; `expired` takes a time of that clock).
        self.clock = clock
        # The worker's side channel ("host:port"), where decode engines read what this one lends.
        self.address = ""
        # request id -> (the finished request whose blocks are lent, when its lease ends).
        self.lent: dict[str, tuple[Request, float]] = {}
        self._ops = _Ops()
        # Counters (never reset): pulls sent and their blocks, blocks whose pull failed;
        # requests lent, read by a decode engine, taken back at the end of their lease.
        self.num_pulls = 0
        self.num_pull_tokens = 0  # the external tokens the pulls' requests were admitted with
        self.num_pull_blocks = 0
        self.num_pull_failed_blocks = 0
        self.num_refused_pulls = 0  # requests whose params named blocks this engine cannot read (computed here)
        self.num_lent = 0
        self.num_sent = 0
        self.num_expired = 0

    def attach(self, address: str) -> None:
        """A worker said hello with its side channel ("" when it has none). Whatever was
        planned for the worker before is void (`clear` first)."""
        if self.config.is_producer and not address:
            raise ValueError("the worker lends no KV (its hello names no side channel): give it the same --kv-transfer-config")
        self.address = address

    # --- a decode engine ----------------------------------------------------------------

    def num_remote_tokens(self, request: Request, num_computed_tokens: int) -> int:
        """Tokens of ``request``'s prompt after its ``num_computed_tokens`` that a prefill
        engine holds for it (0: none, or read already). As vLLM's, the whole prompt: its
        last token is then computed again here, for the first sample. Params whose blocks
        this engine cannot read (pd_remote_blocks.py `remote_span`) are dropped, logged by
        the key: the prompt is computed here."""
        span = self._span(request)
        return 0 if span is None else max(0, span.num_tokens - num_computed_tokens)

    def _span(self, request: Request) -> RemoteSpan | None:
        params = request.kv_transfer_params
        if params is None or not params.do_remote_prefill or not self.config.is_consumer:
            return None
        span = remote_span(params.remote_block_ids, self.group_windows, self.block_size, params.remote_num_tokens, request.num_prompt_tokens)
        if isinstance(span, str):
            log.warning("request %s: %s; its prompt is computed here", request.request_id, span)
            request.kv_transfer_params = None  # NOTE: refused once; the prefill engine's lease frees its blocks
            self.num_refused_pulls += 1
            return None
        return span

    def add_pull(self, pull_id: int, request: Request, targets: Sequence[tuple[int, int, KVCacheBlock]], num_tokens: int) -> None:
        """Read the prefill engine's blocks of ``request`` into ``targets`` ((group, table
        position, new uncached block), `KVCacheManager.load_targets`), ``num_tokens`` tokens, in
        this step's plan: each target from the prefill's block at its position in its group
        (pd_remote_blocks.py; ValueError for one not lent). A request pulls once: a preempted
        one computes what it lost (its prefill engine freed the blocks)."""
        params = request.kv_transfer_params
        span = self._span(request)
        if span is None:
            raise ValueError(f"request {request.request_id} has no blocks to pull")
        remote, local = pull_lists(params.remote_block_ids, span, targets)
        ops = self._ops
        ops.pull_ids.append(pull_id)
        ops.pull_addresses.append(f"{params.remote_host}:{params.remote_port}")
        ops.pull_request_ids.append(params.remote_request_id)
        ops.pull_remote_block_ids.append(remote)
        ops.pull_block_ids.append(local)
        request.kv_transfer_params = None  # pulled (or tried): never again
        self.num_pulls += 1
        self.num_pull_tokens += num_tokens
        self.num_pull_blocks += len(local)

    def pulled(self, num_requested: int, num_pulled: int) -> None:
        """A pull ended: ``num_pulled`` of its ``num_requested`` blocks were read."""
        self.num_pull_failed_blocks += num_requested - num_pulled

    # --- a prefill engine ---------------------------------------------------------------

    def wants_lend(self, request: Request) -> bool:
        params = request.kv_transfer_params
        return params is not None and params.do_remote_decode and self.config.is_producer

    def lend(self, request: Request, tables: Sequence[Sequence[int]]) -> dict[str, Any]:
        """Keep ``request``'s blocks (``tables``: its table in every group, 0 for a null entry,
        `KVCacheManager.get_block_ids`) for a decode engine until it reads them or the lease
        passes; the answer's ``kv_transfer_params`` (``remote_block_ids``: what is lent, one
        list per group, pd_remote_blocks.py `lent_block_ids`)."""
        host, _, port = self.address.rpartition(":")
        lent = lent_block_ids(tables, self.group_windows, self.block_size)
        self.lent[request.request_id] = (request, self.clock() + self.config.kv_lease_duration)
        self._ops.lend_ids.append(request.request_id)
        self._ops.lend_block_ids.append(lent)
        self.num_lent += 1
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [list(g) for g in lent],
                "remote_engine_id": self.config.engine_id, "remote_request_id": request.request_id,
                "remote_host": host, "remote_port": int(port), "remote_num_tokens": request.num_computed_tokens,
                "tp_size": 1}

    def sent(self, request_ids: list[str]) -> list[Request]:
        """The worker reports these lent requests read: theirs to free (unknown ids skipped)."""
        done = [entry[0] for rid in request_ids if (entry := self.lent.pop(rid, None)) is not None]
        self.num_sent += len(done)
        return done

    def expired(self, now: float) -> list[Request]:
        """Lent requests whose lease has passed: taken back (the next plan says so, before
        its forward may write their blocks), theirs to free."""
        gone = [rid for rid, (_, deadline) in self.lent.items() if deadline <= now]
        self._ops.unlend_ids.extend(gone)
        self.num_expired += len(gone)
        return [self.lent.pop(rid)[0] for rid in gone]

    # --- the step's ops -----------------------------------------------------------------

    def take_ops(self) -> KVTransferOps | None:
        """The lends, take-backs and pulls for the plan being built (None: none)."""
        ops = self._ops
        if not (ops.lend_ids or ops.unlend_ids or ops.pull_ids):
            return None  # NOTE: most steps: nothing allocated
        self._ops = _Ops()
        return KVTransferOps(ops.lend_ids, ops.lend_block_ids, ops.unlend_ids, ops.pull_ids, ops.pull_addresses,
                             ops.pull_request_ids, ops.pull_remote_block_ids, ops.pull_block_ids)

    def clear(self) -> list[Request]:
        """The worker is gone, with its memory: nothing lent any more (the lent requests,
        theirs to free), nothing planned."""
        self._ops = _Ops()
        gone = [request for request, _ in self.lent.values()]
        self.lent.clear()
        return gone
