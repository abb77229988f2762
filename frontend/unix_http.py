"""A GET over a Unix domain socket, for ``kvpool serve --uds``: the launcher asks the
frontend's /health there (the standard library's HTTP client, connected to the path;
TLS over it when the frontend has --ssl-certfile, as uvicorn serves vLLM's)."""

from __future__ import annotations

import http.client
import socket
import ssl


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float, context: ssl.SSLContext | None):
        super().__init__("localhost", timeout=timeout)
        self.unix_path, self.context = path, context

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.unix_path)
            self.sock = self.context.wrap_socket(sock) if self.context is not None else sock
        except OSError:
            sock.close()
            raise


def unix_http_ok(path: str, url: str, context: ssl.SSLContext | None = None, timeout: float = 2.0) -> bool:
    """Whether GET ``url`` on the socket at ``path`` answers 200 (over TLS with ``context``)."""
    conn = _UnixConnection(path, timeout, context)
    try:
        conn.request("GET", url)
        return conn.getresponse().status == 200
    except (OSError, http.client.HTTPException):
        return False
    finally:
        conn.close()
