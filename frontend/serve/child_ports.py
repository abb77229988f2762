"""The loopback ports ``kvpool serve`` chooses for its children's own sockets (the
scheduler's client and worker sockets, the scheduler's and the worker's HTTP sides).

They are chosen free by binding port 0, then closed for the children to bind. In between,
the kernel may hand one to another process (most often as an outgoing connection's
ephemeral port): `taken_ports` tells the launcher so, and it starts its children again on
other ports rather than failing.
"""

from __future__ import annotations

import errno
import socket


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """n distinct free ports (every socket held open until all are chosen)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def taken_ports(ports: list[int], host: str = "127.0.0.1") -> list[int]:
    """The ``ports`` another process holds now (a bind fails even with SO_REUSEADDR, which
    lets a port whose connections are only closing be bound again)."""
    taken = []
    for port in ports:
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((host, port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    taken.append(port)
    return taken
