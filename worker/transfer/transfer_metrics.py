"""P/D disaggregation's metrics, read from the server's and the puller's counters at each scrape
(kvpool's own names: vLLM's NixlConnector reports its transfers in its own stats, not these)."""

from __future__ import annotations

from collections.abc import Iterator

from worker.counter_families import LabelledCounters
from worker.transfer.kv_transfer import KVTransfer


class KVTransferCollector(LabelledCounters):
    def __init__(self, transfer: KVTransfer, labels: dict[str, str]):
        super().__init__(list(labels), list(labels.values()))
        self.transfer = transfer

    def collect(self) -> Iterator:
        if (puller := self.transfer.puller) is not None:
            c = puller.counters
            yield self._counter("kvpool_kv_transfer_pulled_blocks", "KV blocks read from prefill workers and written here.", c.pulled_blocks)
            yield self._counter("kvpool_kv_transfer_pulled_bytes", "Bytes of KV blocks read from prefill workers.", c.pulled_bytes)
            yield self._counter("kvpool_kv_transfer_pull_seconds", "Seconds of pulls that wrote their blocks.", c.pull_seconds)
            yield self._by_reason("kvpool_kv_transfer_pull_failures",
                                  "Pulls that wrote nothing: unknown, blocks, identity, malformed (refused), timeout, size, "
                                  "reply, address or error.", c.failures)
        if (server := self.transfer.server) is not None:
            c = server.counters
            yield self._counter("kvpool_kv_transfer_served_blocks", "Lent KV blocks read by decode workers.", c.served_blocks)
            yield self._counter("kvpool_kv_transfer_served_bytes", "Bytes of lent KV blocks read by decode workers.", c.served_bytes)
            yield self._counter("kvpool_kv_transfer_serve_seconds", "Seconds spent gathering and sending lent blocks.", c.serve_seconds)
            yield self._by_reason("kvpool_kv_transfer_refused_reads", "Reads refused: unknown, blocks, identity or malformed.", c.refusals)
