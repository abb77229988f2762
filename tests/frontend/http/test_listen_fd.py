"""kvpool serve binds the API's socket itself and hands it to each frontend
(``--listen-fd``): binding names the address it could not take; a descriptor that is not
a listening socket is refused by name; an inherited socket serves, and connections made
before any frontend accepts wait in its backlog instead of being refused."""

from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path

import pytest
from kvtest.ports import free_port

from frontend.http.listen import bind_listener, inherited


def test_an_address_in_use_is_named():
    taken = bind_listener("127.0.0.1", free_port(), None, 8)
    try:
        port = taken.getsockname()[1]
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}: Address already in use"):
            bind_listener("127.0.0.1", port, None, 8)
    finally:
        taken.close()


def test_a_unix_path_already_there_is_named():
    d = Path(tempfile.mkdtemp(prefix="kvfd", dir="/tmp"))
    path = str(d / "api.sock")
    first = bind_listener("ignored", 0, path, 8)
    try:
        with pytest.raises(OSError, match=f"cannot listen on --uds {path}: Address already in use"):
            bind_listener("ignored", 0, path, 8)
    finally:
        first.close()
        os.unlink(path)
        d.rmdir()


def test_a_descriptor_that_is_not_a_listening_socket_is_refused():
    plain = socket.socket()
    try:
        with pytest.raises(OSError, match=f"--listen-fd {plain.fileno()} is not a listening socket"):
            inherited(plain.fileno())
        assert plain.fileno() >= 0  # still the caller's, open
    finally:
        plain.close()
    r, w = os.pipe()
    try:
        with pytest.raises(OSError, match=f"--listen-fd {r} is not"):
            inherited(r)
    finally:
        os.close(r)
        os.close(w)


def test_connections_before_anyone_accepts_wait_in_the_backlog():
    listener = bind_listener("127.0.0.1", free_port(), None, 64)
    try:
        port = listener.getsockname()[1]
        assert listener.get_inheritable()
        clients = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(10)]  # nobody accepts yet
        try:
            for c in clients:
                c.sendall(b"ping")
            served = inherited(os.dup(listener.fileno()))  # what the next frontend does with the descriptor
            try:
                served.settimeout(5)
                for _ in clients:
                    conn, _ = served.accept()
                    with conn:
                        assert conn.recv(4) == b"ping"
            finally:
                served.close()
        finally:
            for c in clients:
                c.close()
    finally:
        listener.close()
