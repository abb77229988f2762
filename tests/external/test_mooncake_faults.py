"""A Mooncake Store tier whose master goes away mid-service: the scheduler and worker of the
tiny checkpoint (real processes) keep serving every request with the same greedy tokens,
stop saving (a metric and a log line), and find nothing in a store they cannot reach.
"""

from __future__ import annotations

import random

import pytest
from kvtest.cluster import Cluster
from kvtest.ports import free_port
from prometheus_client.parser import text_string_to_metric_families

from bench.external_store_io import MooncakeMaster
from protocol.client_messages import Generate

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

BLOCK = 16


def requests(tag: str, prompts: list[list[int]]) -> list[Generate]:
    return [Generate(f"{tag}-{i}", p, max_tokens=6, ignore_eos=True) for i, p in enumerate(prompts)]


def worker_samples(c: Cluster, port: int) -> dict[tuple[str, str], float]:
    out = {}
    for f in text_string_to_metric_families(c.metrics_text(port)):
        for s in f.samples:
            key = (s.name, s.labels.get("reason", ""))
            out[key] = out.get(key, 0.0) + s.value
    return out


def test_an_unreachable_store_stops_saving_and_serving_goes_on(needs_mooncake, tmp_path):
    rng = random.Random(9)
    prompts = [[rng.randrange(2, 512) for _ in range(4 * BLOCK + 3)] for _ in range(3)]
    master = MooncakeMaster(tmp_path, (free_port(), free_port(), free_port(), free_port()), store_bytes=32 << 20)
    master.start()
    try:
        store = ["--kv-offloading-backend", "mooncake", "--mooncake-master", master.master_address, "--mooncake-metadata", master.metadata_server]
        worker_http = free_port()
        (tmp_path / "logs").mkdir()
        with Cluster(["--num-gpu-blocks-override", "12", "--max-num-seqs", "1", *store],
                     ["--dtype", "float32", *store, "--http-port", str(worker_http)], log_dir=tmp_path / "logs") as c:
            first = {rid: r.token_ids for rid, r in c.generate(requests("a", prompts), timeout=60).items()}
            master.stop()
            # The same prompts and new ones, with the store gone: every one served, the same tokens.
            later = c.generate(requests("b", prompts) + requests("c", [p[::-1] for p in prompts]), timeout=120)
            assert all(r.error is None and r.finish_reason == "length" for r in later.values()), later
            assert [later[f"b-{i}"].token_ids for i in range(len(prompts))] == [first[f"a-{i}"] for i in range(len(prompts))]
            m = c.metrics()
            w = worker_samples(c, worker_http)
            log = (tmp_path / "logs" / "scheduler.log").read_text()
        # The scheduler found the master gone: the tier counts as empty, nothing is saved to it.
        assert m["kvpool_kv_offload_external_unreachable_total"] >= 1
        assert "did not answer" in log
        # Every save the plans asked for was made, failed or skipped while paused: none lost track of.
        failed = sum(v for (name, _), v in w.items() if name == "kvpool_kv_offload_tiering_save_failures_total")
        made = w[("kvpool_kv_offload_tiering_saved_blocks_total", "")] + failed + w[("kvpool_kv_offload_tiering_saves_paused_total", "")]
        assert m["kvpool_kv_offload_external_saved_blocks_total"] == made > 0
        # Nothing was loaded from a store that was not there.
        assert w[("kvpool_kv_offload_tiering_loaded_blocks_total", "")] == 0
    finally:
        master.stop()
