"""The external tier's metrics, read from ExternalIO's counters at each scrape.

Named as vLLM's tiered offloading names them (vllm/v1/kv_offload/tiering/base.py: its
``tier`` label is ``"<index>:<type>"``; the host tier, where there is one, is vLLM's
primary tier, so the external one is ``1:disk`` or ``1:mooncake``), and kvpool's own for
what vLLM does not count: blocks refused at load, by why, and failed saves, by why.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily

from worker.counter_families import LabelledCounters
from worker.external.external_io import ExternalIO


class ExternalIOCollector(LabelledCounters):
    def __init__(self, io: ExternalIO, labels: dict[str, str]):
        super().__init__([*labels, "tier"], [*labels.values(), f"1:{io.store.name}"])
        self.io = io

    def collect(self) -> Iterator:
        c = self.io.counters
        yield self._counter("vllm:kv_offload_tiering_read_bytes", "Bytes read from the tier into device blocks (checked).", c.loaded_bytes)
        yield self._counter("vllm:kv_offload_tiering_read_time", "Seconds of loads from the tier.", c.load_seconds)
        yield self._counter("vllm:kv_offload_tiering_write_bytes", "Bytes of blocks saved to the tier.", c.saved_bytes)
        yield self._counter("vllm:kv_offload_tiering_write_time", "Seconds of saves to the tier.", c.save_seconds)
        yield self._counter("kvpool_kv_offload_tiering_loaded_blocks", "Blocks loaded from the tier (read and checked).", c.loaded_blocks)
        yield self._counter("kvpool_kv_offload_tiering_saved_blocks", "Blocks saved to the tier.", c.saved_blocks)
        yield self._counter("kvpool_kv_offload_tiering_saves_paused", "Saves not tried: saving was paused after a failed save.", c.saves_paused)
        yield self._counter("kvpool_kv_offload_tiering_saves_dropped",
                            "Saves not queued: the saves waiting to be written held too many bytes already (a store slower than prefill).",
                            c.saves_dropped)
        yield self._by_reason("kvpool_kv_offload_tiering_bad_blocks",
                              "Blocks a load could not use, computed again instead: missing, truncated, checksum, foreign, key, "
                              "magic, version, io or unreachable.", c.load_failures)
        yield self._by_reason("kvpool_kv_offload_tiering_save_failures", "Saves that failed: full, io or unreachable.", c.save_failures)
        paused = GaugeMetricFamily("kvpool_kv_offload_tiering_saving_paused", "1 while saving is paused after a failed save.", labels=self.names)
        paused.add_metric(self.values, float(self.io.saving_paused))
        yield paused
