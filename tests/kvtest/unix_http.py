"""HTTP over a Unix domain socket (``--uds``), with the standard library's client."""

from __future__ import annotations

import http.client
import json
import socket


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float = 10.0):
        super().__init__("localhost", timeout=timeout)
        self.path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def request(path: str, method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of one request to the server on the socket at ``path``."""
    conn = UnixHTTPConnection(path, timeout)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, url, body=data, headers={"Content-Type": "application/json"} if data else {})
        r = conn.getresponse()
        return r.status, r.read()
    finally:
        conn.close()


def answers(path: str, url: str = "/health") -> bool:
    try:
        return request(path, "GET", url, timeout=2)[0] == 200
    except (OSError, http.client.HTTPException):
        return False
