"""A GET over a Unix domain socket, for ``kvpool serve --uds``: the launcher asks the
frontend's /health there (the standard library's HTTP client, connected to the path)."""

from __future__ import annotations

import http.client
import socket


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def unix_http_ok(path: str, url: str, timeout: float = 2.0) -> bool:
    """Whether GET ``url`` on the socket at ``path`` answers 200."""
    conn = _UnixConnection(path, timeout)
    try:
        conn.request("GET", url)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
