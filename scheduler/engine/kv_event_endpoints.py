"""Where the KV events publisher's sockets go: which endpoints are bound (loopback only
without CURVE) and which connected to (vLLM's rule, for --kv-events-endpoint-mode vllm)."""

from __future__ import annotations

import ipaddress

ENDPOINT_MODES = ("bind", "vllm")


def is_bind_endpoint(endpoint: str, endpoint_mode: str = "bind") -> bool:
    """Whether the PUB socket binds ``endpoint`` (else it connects); vLLM's rule for "vllm"."""
    if endpoint_mode == "bind":
        return True
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def check_connect_endpoint(endpoint: str, what: str = "endpoint") -> None:
    """Raise ValueError unless ``endpoint`` is tcp://HOST:PORT, one a PUB socket can connect to."""
    scheme, sep, rest = endpoint.partition("://")
    host, colon, port = rest.rpartition(":")
    if not (sep and scheme == "tcp" and host and colon and port.isdigit()):
        raise ValueError(f"{what} {endpoint!r}: expected tcp://HOST:PORT to connect to (or a wildcard, ipc:// or inproc:// to bind)")


def check_local_endpoint(endpoint: str, what: str = "endpoint", allow_remote: bool = False) -> None:
    """Raise ValueError unless ``endpoint`` is loopback tcp (any tcp host with
    ``allow_remote``), ipc:// or inproc://."""
    scheme, sep, rest = endpoint.partition("://")
    if sep and scheme in ("ipc", "inproc") and rest:
        return
    if sep and scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not (port.isdigit() or port == "*"):
            raise ValueError(f"{what} {endpoint!r}: expected tcp://HOST:PORT")
        host = host.removeprefix("[").removesuffix("]")
        if allow_remote or host == "localhost" or _is_loopback_ip(host):
            return
        raise ValueError(
            f"{what} {endpoint!r} is not a loopback address: publishing KV events on it without "
            "CURVE authentication is refused; use tcp://127.0.0.1:PORT, ipc:// or inproc://, "
            "or turn CURVE on"
        )
    raise ValueError(f"{what} {endpoint!r}: expected tcp://127.0.0.1:PORT, ipc://PATH or inproc://NAME")


def _is_loopback_ip(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
