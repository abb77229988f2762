"""A ``host:port`` address, and whether something listens there: for the clients of outside
services (a Mooncake master) that must fail fast where the service's own client would retry
for seconds."""

from __future__ import annotations

import socket


def split_address(address: str, what: str) -> tuple[str, int]:
    """``host:port`` as (host, port); ValueError naming ``what`` otherwise."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{what} {address!r} is not host:port")
    return host.strip("[]"), int(port)


def accepts(host: str, port: int, timeout: float) -> bool:
    """Whether ``host:port`` accepts a TCP connection within ``timeout`` seconds."""
    try:
        socket.create_connection((host, port), timeout=timeout).close()
    except OSError:
        return False
    return True
