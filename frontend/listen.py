"""Where the API listens: ``--host``/``--port``, or ``--uds PATH``, a Unix domain socket
in their place, as vLLM's ``create_server_unix_socket`` binds it (the path must not
exist yet: a file there, a stale socket too, is an error naming it)."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import stat

from aiohttp import web

from frontend.config import FrontendConfig


def site(runner: web.AppRunner, config: FrontendConfig, tls: ssl.SSLContext | None) -> web.BaseSite:
    if config.uds is None:
        return web.TCPSite(runner, config.host, config.port, ssl_context=tls)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(config.uds)
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on --uds {config.uds}: {e.strerror or e}") from None
    return web.SockSite(runner, sock, ssl_context=tls)


def listen_address(config: FrontendConfig) -> str:
    """As vLLM logs it: ``unix:PATH``, else the URL (with ``--root-path``)."""
    if config.uds is not None:
        return f"unix:{config.uds}"
    scheme = "https" if config.ssl_certfile else "http"
    return f"{scheme}://{config.host}:{config.port}{config.root_path or ''}"


def remove_socket(config: FrontendConfig, inode: int | None) -> None:
    """After a stop: the socket file this process bound (``inode``), if still there.
    NOTE: vLLM leaves it behind, so its next start on the path fails; removing
    only our own socket never deletes a file someone put there since."""
    if config.uds is None or inode is None:
        return
    with contextlib.suppress(OSError):
        st = os.stat(config.uds)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            os.unlink(config.uds)


def socket_inode(config: FrontendConfig) -> int | None:
    if config.uds is None:
        return None
    try:
        return os.stat(config.uds).st_ino
    except OSError:
        return None
