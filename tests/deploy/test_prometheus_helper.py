"""The Prometheus fixture, against a tiny prometheus_client exporter on a random port."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Gauge, start_http_server

pytestmark = pytest.mark.slow


def test_prometheus_scrapes_a_gauge(prometheus_server):
    registry = CollectorRegistry()
    gauge = Gauge("kvpool_test_gauge", "a test value", registry=registry)
    gauge.set(42.5)
    server, thread = start_http_server(0, addr="127.0.0.1", registry=registry)
    try:
        port = server.server_address[1]
        prom = prometheus_server([f"127.0.0.1:{port}"])
        assert prom.wait_for_value("kvpool_test_gauge", timeout=30) == 42.5
        assert prom.wait_for_value('up{job="test"}', timeout=5) == 1.0
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
