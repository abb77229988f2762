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
    if config.listen_fd is not None:
        return web.SockSite(runner, inherited(config.listen_fd), ssl_context=tls)
    if config.uds is None:
        return web.TCPSite(runner, config.host, config.port, ssl_context=tls)
    return web.SockSite(runner, bind_listener(config.host, config.port, config.uds, UDS_BACKLOG), ssl_context=tls)


def inherited(fd: int) -> socket.socket:
    """The listening socket a parent bound and passed down (``--listen-fd``)."""
    try:
        sock = socket.socket(fileno=fd)
    except OSError as e:
        raise OSError(f"--listen-fd {fd} is not an open socket: {e.strerror or e}") from None
    if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN) != 1:
        sock.detach()
        raise OSError(f"--listen-fd {fd} is not a listening socket")
    return sock


# NOTE: aiohttp's own backlog, which its server sets again when it starts on the socket.
UDS_BACKLOG = 128


def bind_listener(host: str, port: int, uds: str | None, backlog: int) -> socket.socket:
    """A listening socket on ``host``:``port`` (as aiohttp binds it: SO_REUSEADDR), or on
    the Unix socket ``uds`` (as ``site`` binds it), inheritable, for ``--listen-fd``;
    OSError naming the address when it cannot bind."""
    where = f"--uds {uds}" if uds is not None else f"{host}:{port}"
    sock = None
    try:
        if uds is not None:
            sock, addr = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), uds
        else:
            family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            sock = socket.socket(family, kind, proto)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(backlog)
    except OSError as e:
        if sock is not None:
            sock.close()
        raise OSError(f"cannot listen on {where}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


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
    remove_unix_socket(config.uds, inode)


def remove_unix_socket(path: str | None, inode: int | None) -> None:
    """The socket file at ``path``, if it is still the one bound (``inode``)."""
    if path is None or inode is None:
        return
    with contextlib.suppress(OSError):
        st = os.stat(path)
        if stat.S_ISSOCK(st.st_mode) and st.st_ino == inode:
            os.unlink(path)


def socket_inode(config: FrontendConfig) -> int | None:
    if config.uds is None:
        return None
    try:
        return os.stat(config.uds).st_ino
    except OSError:
        return None
