"""A P/D fleet on this host: ``kvpool serve`` prefill and decode engines behind vllm-router's
PD mode (``--vllm-pd-disaggregation``), each engine a process group of its own, every port
free and loopback. The e2e tests and the P/D benchmark start it; deploy/run-pd.sh is the
same fleet for a user.

The router sends each request to a prefill engine (``kv_transfer_params``
``{"do_remote_decode": true}``, max_tokens 1), then to a decode engine with the params of
that answer; the decode engine reads the prompt's blocks from the prefill engine's worker
(docs/pd-disaggregation.md)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.replicas import Replica, Router

# Each engine's connector: a prefill engine lends, a decode engine reads; a read that fails
# is computed again (vLLM's "recompute"; its default, "fail", would end the request).
PRODUCER = {"kv_connector": "KVPoolConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "recompute"}
CONSUMER = {"kv_connector": "KVPoolConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}


def transfer_flag(config: dict, **extra) -> tuple[str, str]:
    """``--kv-transfer-config JSON`` of ``config``, with ``extra`` in its kv_connector_extra_config."""
    return "--kv-transfer-config", json.dumps({**config, "kv_connector_extra_config": extra} if extra else config)


class PDRouter(Router):
    """``vllm-router --vllm-pd-disaggregation`` over prefill and decode engines, on a free loopback port."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], log_path: Path, policy: str = "round_robin",
                 log_level: str = "warning"):
        pd = ["--vllm-pd-disaggregation"]
        for url in prefill_urls:
            pd += ["--prefill", url]
        for url in decode_urls:
            pd += ["--decode", url]
        super().__init__([], policy, log_path, *pd, log_level=log_level)


class PDFleet:
    """``num_prefill`` prefill and ``num_decode`` decode engines of ``model`` and their router.
    ``common``: flags every engine gets; ``producer_extra`` / ``consumer_extra``: their
    connectors' extra config (a lease, a read timeout). Stop it (also on failure)."""

    def __init__(self, model: Path | str, work: Path, num_prefill: int = 1, num_decode: int = 1, *common: str,
                 producer_extra: dict | None = None, consumer_extra: dict | None = None, policy: str = "round_robin"):
        self.work = Path(work)
        self.prefills: list[Replica] = []
        self.decodes: list[Replica] = []
        self.router: PDRouter | None = None
        try:
            for i in range(num_prefill):
                flag = transfer_flag(PRODUCER, **(producer_extra or {}))
                self.prefills.append(Replica(model, self.work / f"prefill{i}", *common, *flag))
            for i in range(num_decode):
                flag = transfer_flag(CONSUMER, **(consumer_extra or {}))
                self.decodes.append(Replica(model, self.work / f"decode{i}", *common, *flag))
            for r in self.engines:
                r.wait_ready()
            self.router = PDRouter([r.url for r in self.prefills], [r.url for r in self.decodes], self.work / "router.log", policy)
            self.router.wait_ready()
        except BaseException:
            self.stop()
            raise

    @property
    def engines(self) -> list[Replica]:
        return self.prefills + self.decodes

    @property
    def url(self) -> str:
        return self.router.url

    def logs(self) -> str:
        tail = "" if self.router is None else f"--- router\n{self.router.log_tail()}\n"
        return tail + "\n".join(r.logs() for r in self.engines)

    def stop(self) -> None:
        if self.router is not None:
            self.router.stop()
        for r in self.engines:
            r.stop()
