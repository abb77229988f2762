"""Free TCP ports for the servers a test starts, one source for every test.

A port from ``bind(("127.0.0.1", 0))`` comes from the kernel's ephemeral range, the
range every outgoing connection draws its local port from: between the probe socket
closing and the server binding the port, any connect() on the machine (an HTTP
client, a ZeroMQ reconnect, another CI job) may take it, and the server fails with
"address already in use". So ports are drawn below that range, each checked free,
and never handed out twice in one test run.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

# NOTE: above 17999: Mooncake's clients (tests/external, the mooncake tier's tests) bind two
# random ports each in about 12000-17000, which a port drawn there could meet.
_FLOOR = 18000
_given: set[int] = set()
_rng = random.Random()  # seeded from os.urandom: parallel jobs draw different ports


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def free_port() -> int:
    high = _ephemeral_low() - 1
    if high <= _FLOOR:
        raise RuntimeError(f"the ephemeral port range starts at {high + 1}: no room below it for test servers")
    for _ in range(1000):
        port = _rng.randint(_FLOOR, high)
        if port in _given:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _given.add(port)
        return port
    raise RuntimeError(f"no free TCP port in {_FLOOR}-{high} after 1000 tries")
