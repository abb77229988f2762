"""--enable-ssl-refresh, as vLLM's SSLCertRefresher: rotating the key and certificate
files reloads them into the running server's context, for the connections made after;
a file that does not load is logged and the old certificate stays. A real
``python -m frontend``, then a real ``kvpool serve`` over HTTPS; certificates made with `openssl`."""

from __future__ import annotations

import shutil
import socket
import ssl
import time
import urllib.request
from pathlib import Path

import pytest
from kvtest.certs import make_ca, make_server_cert
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.serve import kvpool_serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
WAIT_S = 20.0


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    make_ca(d)
    make_server_cert(d, "old", "kvpool old")
    make_server_cert(d, "new", "kvpool new")
    return d


def served_cn(port: int, ca: Path) -> str:
    """The CN of the certificate a new connection to 127.0.0.1:port is shown."""
    ctx = ssl.create_default_context(cafile=str(ca))
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        return dict(x[0] for x in s.getpeercert()["subject"])["commonName"]


def until_cn(port: int, ca: Path, cn: str) -> str:
    deadline = time.monotonic() + WAIT_S
    while (seen := served_cn(port, ca)) != cn and time.monotonic() < deadline:
        time.sleep(0.2)
    return seen


def _start(model: Path, made: Path, live: Path, engine, log: Path, *flags: str):
    for suffix in ("pem", "key"):
        shutil.copy(made / f"old.{suffix}", live / f"server.{suffix}")
    tls = ("--ssl-certfile", str(live / "server.pem"), "--ssl-keyfile", str(live / "server.key"))
    return frontend_process(model, engine, log, *tls, *flags, scheme="https")


def test_rotated_files_are_served_to_new_connections(tiny_checkpoint, made, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    with fake_engine() as engine, _start(tiny_checkpoint, made, live, engine, tmp_path / "f.log", "--enable-ssl-refresh") as f:
        ca = made / "ca.pem"
        assert served_cn(f.port, ca) == "kvpool old"
        held = ssl.create_default_context(cafile=str(ca)).wrap_socket(socket.create_connection(("127.0.0.1", f.port), timeout=10),
                                                                       server_hostname="127.0.0.1")
        try:
            shutil.copy(made / "new.key", live / "server.key")  # the key first: the pair loads once both are written
            shutil.copy(made / "new.pem", live / "server.pem")
            assert until_cn(f.port, ca, "kvpool new") == "kvpool new"
            held.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            assert held.recv(64).startswith(b"HTTP/1.1 200")  # a connection made before still serves
        finally:
            held.close()
        (live / "server.pem").write_text("not a certificate\n")
        deadline = time.monotonic() + WAIT_S
        while "SSLCertRefresher failed taking action on file change" not in f.output() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "SSLCertRefresher failed taking action on file change" in f.output()
        assert served_cn(f.port, ca) == "kvpool new"  # a file that does not load changes nothing


def test_without_the_flag_the_start_up_certificate_stays(tiny_checkpoint, made, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    with fake_engine() as engine, _start(tiny_checkpoint, made, live, engine, tmp_path / "f.log") as f:
        shutil.copy(made / "new.key", live / "server.key")
        shutil.copy(made / "new.pem", live / "server.pem")
        time.sleep(2.0)  # NOTE: eight of the refresher's polls: long enough that a watching server would have reloaded
        assert served_cn(f.port, made / "ca.pem") == "kvpool old"


def test_kvpool_serve_over_https_passes_the_tls_flags_and_refreshes(tiny_checkpoint, made, tmp_path):
    live = tmp_path / "live"
    live.mkdir()
    for suffix in ("pem", "key"):
        shutil.copy(made / f"old.{suffix}", live / f"server.{suffix}")
    cipher = "ECDHE-RSA-AES128-GCM-SHA256"
    flags = ("--ssl-certfile", str(live / "server.pem"), "--ssl-keyfile", str(live / "server.key"), "--ssl-ciphers", cipher, "--enable-ssl-refresh")
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", *flags) as s:
        assert f"ready at https://127.0.0.1:{s.port}/v1" in s.ready_line
        ca = made / "ca.pem"
        ctx = ssl.create_default_context(cafile=str(ca))
        with urllib.request.urlopen(f"https://127.0.0.1:{s.port}/health", timeout=10, context=ctx) as r:
            assert r.status == 200
        tls12 = ssl.create_default_context(cafile=str(ca))
        tls12.maximum_version = ssl.TLSVersion.TLSv1_2
        with socket.create_connection(("127.0.0.1", s.port), timeout=10) as raw, tls12.wrap_socket(raw, server_hostname="127.0.0.1") as t:
            assert t.cipher()[0] == cipher
        assert served_cn(s.port, ca) == "kvpool old"
        shutil.copy(made / "new.key", live / "server.key")
        shutil.copy(made / "new.pem", live / "server.pem")
        assert until_cn(s.port, ca, "kvpool new") == "kvpool new"
