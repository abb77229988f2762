"""kvpool serve's readiness probe of its frontend (frontend/serve/ready_probe.py); its HTTPS and
--uds paths run end to end in test_tls.py, test_ssl_refresh.py and test_uds.py."""

from __future__ import annotations

from frontend.engine import scheduler_health
from frontend.serve import ready_probe


def test_the_lag_covers_the_frontends_health_poll_twice():
    # The frontend turns its /health to 200 at its next poll of the scheduler's.
    assert ready_probe.HEALTH_LAG_S >= 2 * scheduler_health.HEALTH_POLL_S


def test_only_ssl_cert_reqs_2_requires_client_certificates():
    assert [ready_probe.requires_client_certificates(v) for v in (None, "0", "1", "2", " 2", "x")] == [False, False, False, True, True, False]
