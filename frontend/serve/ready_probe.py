"""How ``kvpool serve`` asks whether its frontend is up: GET /health on --host/--port, or
on the ``--uds`` socket; over TLS when the frontend has ``--ssl-certfile``, not verifying
the certificate (the launcher's own child on this host, asked only whether it is up).

A frontend that requires client certificates (``--ssl-cert-reqs 2``) answers no client
without one: there, a TLS 1.3 handshake completing says it is listening (the client's
side ends before the server checks the client's certificate), and the scheduler's
/health, held for ``HEALTH_LAG_S`` (so that the frontend's own /health, which follows
it, has seen it too), says the rest."""

from __future__ import annotations

import http.client
import socket
import ssl
import time
import urllib.request

TIMEOUT_S = 2.0
# NOTE: twice the frontend's HEALTH_POLL_S (frontend/engine/scheduler_health.py), the period at which
# it asks the scheduler's /health and turns its own to 200.
HEALTH_LAG_S = 1.0


def http_ok(url: str, context: ssl.SSLContext | None = None) -> bool:
    try:
        return urllib.request.urlopen(url, timeout=TIMEOUT_S, context=context).status == 200
    except (OSError, http.client.HTTPException):
        return False


def unverified_context() -> ssl.SSLContext:
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


def requires_client_certificates(ssl_cert_reqs: str | None) -> bool:
    """--ssl-cert-reqs as given to kvpool serve (a bad value: the frontend refuses it)."""
    try:
        return ssl_cert_reqs is not None and int(ssl_cert_reqs) == ssl.CERT_REQUIRED
    except ValueError:
        return False


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, context: ssl.SSLContext | None):
        super().__init__("localhost", timeout=TIMEOUT_S)
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


class FrontendProbe:
    def __init__(self, host: str, port: int, uds: str | None, tls: bool, cert_required: bool, scheduler_http: str):
        self.host = "127.0.0.1" if host == "0.0.0.0" else host
        self.port, self.uds, self.scheduler_http = port, uds, scheduler_http
        self.context = unverified_context() if tls else None
        self.cert_required = tls and cert_required
        self._up_since: float | None = None  # cert_required: since when listening with the scheduler healthy

    def _connection(self) -> http.client.HTTPConnection:
        if self.uds is not None:
            return _UnixConnection(self.uds, self.context)
        if self.context is not None:
            return http.client.HTTPSConnection(self.host, self.port, timeout=TIMEOUT_S, context=self.context)
        return http.client.HTTPConnection(self.host, self.port, timeout=TIMEOUT_S)

    def healthy(self) -> bool:
        if self.cert_required:
            if not (self._handshakes() and http_ok(self.scheduler_http + "/health")):
                self._up_since = None
                return False
            self._up_since = self._up_since or time.monotonic()
            return time.monotonic() - self._up_since >= HEALTH_LAG_S
        conn = self._connection()
        try:
            conn.request("GET", "/health")
            return conn.getresponse().status == 200
        except (OSError, http.client.HTTPException):
            return False
        finally:
            conn.close()

    def _handshakes(self) -> bool:
        conn = self._connection()
        try:
            conn.connect()
            return True
        except OSError:  # ssl.SSLError too
            return False
        finally:
            conn.close()
