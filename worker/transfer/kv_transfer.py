"""KVTransfer: this worker's side of P/D disaggregation, by its ``--kv-transfer-config``
role: a KVServer of the blocks it lends (kv_producer), a KVPuller of the blocks it reads
(kv_consumer), or both (kv_both); opened at start-up (`open_kv_transfer`)."""

from __future__ import annotations

import logging

import torch

from protocol.kv_transfer_config import KVTransferConfig
from protocol.worker_messages import KVTransferOps
from worker.kv.kv_block_bytes import kv_block_identity
from worker.kv.kv_cache import distinct_kv_tensors
from worker.load.serving_model import ServingModel
from worker.transfer.kv_puller import KVPuller, Pull
from worker.transfer.kv_server import KVServer

log = logging.getLogger("kvpool.worker.transfer")


class KVTransfer:
    """The server and/or the puller of one worker, and the identity of its KV blocks."""

    def __init__(self, identity: str, server: KVServer | None, puller: KVPuller | None):
        self.identity = identity
        self.server = server
        self.puller = puller

    def apply_lends(self, ops: KVTransferOps) -> None:
        """Unlends then lends of ``ops`` (checked: worker/transfer/ops_check.py)."""
        if self.server is None:
            return
        if ops.unlend_ids:
            self.server.unlend(ops.unlend_ids)
        for request_id, block_ids in zip(ops.lend_ids, ops.lend_block_ids, strict=True):
            self.server.lend(request_id, block_ids)

    def start_pulls(self, ops: KVTransferOps) -> None:
        """Queue the pulls of ``ops`` (checked) on the puller's thread."""
        pulls = [Pull(*p) for p in zip(ops.pull_ids, ops.pull_addresses, ops.pull_request_ids, ops.pull_remote_block_ids,
                                        ops.pull_block_ids, strict=True)]
        if pulls:
            self.puller.submit(pulls)

    @property
    def awaits_news(self) -> bool:
        """Whether news may come from another thread soon: a pull under way, or a lend a
        decode engine may read (its read frees the prefill engine's blocks: reported at once)."""
        return (self.puller is not None and self.puller.has_pending) or (self.server is not None and self.server.has_lends)

    def take_done(self) -> tuple[dict[int, int], list[str]] | None:
        """Pulls ended (pull id -> blocks written) and lent requests read since the last call;
        None when there are none (the fields of a ``KVTransferDone``)."""
        pulled = {} if self.puller is None else self.puller.take_pulled()
        sent = [] if self.server is None else self.server.take_sent()
        return (pulled, sent) if pulled or sent else None

    def reset(self, drain_s: float) -> None:
        """For a new scheduler: lends taken back, pulls finished (bounded by ``drain_s``), their news dropped."""
        if self.server is not None:
            self.server.unlend_all()
        if self.puller is not None:
            if not self.puller.drain(drain_s):
                log.warning("the KV transfer pulls did not finish in %g s", drain_s)
            self.puller.take_pulled()

    def close(self) -> None:
        for part in (self.server, self.puller):
            if part is not None:
                part.close()


def open_kv_transfer(config: KVTransferConfig | None, serving: ServingModel, kv_caches: list[torch.Tensor],
                     block_size: int) -> KVTransfer | None:
    """The KV transfer of ``config`` (None without one). Raises ValueError naming the problem:
    a side channel it cannot bind. A hybrid model's blocks move alike in every KV-cache group
    (each of ``kv_caches`` is shared by one layer of each group: a block id is the same memory)."""
    if config is None:
        return None
    identity = kv_block_identity(serving, kv_caches, block_size)
    kv_caches = distinct_kv_tensors(kv_caches)  # NOTE: blocks move by id: each shared tensor once
    server = KVServer(kv_caches, identity, config.side_channel_host, config.side_channel_port) if config.is_producer else None
    puller = KVPuller(kv_caches, identity, config.read_timeout) if config.is_consumer else None
    if server is not None:
        log.info("KV transfer (%s): serving lent blocks at %s", config.kv_role, server.address)
    if puller is not None:
        log.info("KV transfer (%s): pulling blocks, read timeout %g s", config.kv_role, config.read_timeout)
    return KVTransfer(identity, server, puller)
