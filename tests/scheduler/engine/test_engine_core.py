"""The engine's own lifecycle, in-process: an internal error stops it loudly."""

from __future__ import annotations

import asyncio

from kvtest.cluster import free_port

from scheduler.engine.client_side import ClientSide
from scheduler.engine.config import SchedulerConfig
from scheduler.engine.engine_core import EngineCore


def test_a_loop_that_dies_stops_the_process_with_status_1(monkeypatch, caplog):
    async def broken_receive_loop(self) -> None:
        raise RuntimeError("boom")

    monkeypatch.setattr(ClientSide, "receive_loop", broken_receive_loop)
    config = SchedulerConfig(port=free_port(), worker_port=free_port(), http_port=free_port(), worker_timeout_s=1.0)

    async def main() -> int:
        return await asyncio.wait_for(EngineCore(config).run(), timeout=20)

    assert asyncio.run(main()) == 1
    assert "internal error" in caplog.text and "boom" in caplog.text
