"""--uds PATH, as vLLM: the API listens on a Unix domain socket instead of --host and
--port (a real ``python -m frontend``, then a real ``kvpool serve``, spoken to over the socket)."""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from kvtest import unix_http
from kvtest.certs import make_ca, make_server_cert
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.serve import kvpool_serve


@pytest.fixture
def short_dir():
    # NOTE: a Unix socket's path is at most 107 bytes; pytest's tmp_path can be longer.
    d = Path(tempfile.mkdtemp(prefix="kvuds", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_the_api_answers_on_the_socket_and_not_on_the_port(tiny_checkpoint, short_dir, tmp_path):
    sock = short_dir / "api.sock"
    model = str(tiny_checkpoint)
    with fake_engine() as engine, frontend_process(model, engine, tmp_path / "f.log", "--uds", str(sock), uds=sock) as f:
        status, body = unix_http.request(str(sock), "POST", "/v1/completions", {"model": model, "prompt": "hello", "max_tokens": 3})
        assert status == 200 and json.loads(body)["usage"]["completion_tokens"] == 3
        assert unix_http.request(str(sock), "GET", "/v1/models")[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f.base_url + "/health", timeout=5)
        assert f"on unix:{sock}" in f.output()
        assert sock.is_socket()
        f.proc.terminate()
        assert f.proc.wait(timeout=20) == 0
    assert not sock.exists()  # the socket it bound is removed on a clean stop


def test_a_path_already_there_stops_the_start_naming_it(tiny_checkpoint, short_dir, tmp_path):
    taken = short_dir / "taken.sock"
    other = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    other.bind(str(taken))  # NOTE: as vLLM's bind: even a socket nobody serves on is refused
    try:
        with fake_engine() as engine, pytest.raises(RuntimeError) as e:
            with frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", "--uds", str(taken), uds=taken):
                pass
        assert f"cannot listen on --uds {taken}: Address already in use" in str(e.value)
        assert taken.is_socket()  # not removed: it is not the frontend's
    finally:
        other.close()


def test_kvpool_serve_uds_gets_ready_over_the_socket_and_serves_there(tiny_checkpoint, short_dir, tmp_path):
    sock = short_dir / "serve.sock"
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--uds", str(sock)) as s:
        assert f"ready at unix:{sock} /v1" in s.ready_line
        status, body = unix_http.request(str(sock), "POST", "/v1/completions",
                                         {"model": str(tiny_checkpoint), "prompt": "hello", "max_tokens": 2}, timeout=60)
        assert status == 200, body
        assert json.loads(body)["usage"]["completion_tokens"] == 2
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(s.base_url + "/health", timeout=5)


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")
def test_kvpool_serve_uds_with_tls_gets_ready_and_serves_https_on_the_socket(tiny_checkpoint, short_dir, tmp_path):
    make_ca(tmp_path)
    pem, key = make_server_cert(tmp_path, "server", "kvpool uds")
    sock = short_dir / "tls.sock"
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", "--uds", str(sock), "--ssl-certfile", str(pem), "--ssl-keyfile", str(key)) as s:
        assert f"ready at unix:{sock} /v1" in s.ready_line
        ctx = ssl.create_default_context(cafile=str(tmp_path / "ca.pem"))
        with socket.socket(socket.AF_UNIX) as raw:
            raw.settimeout(10)
            raw.connect(str(sock))
            with ctx.wrap_socket(raw, server_hostname="localhost") as t:
                t.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                assert t.recv(64).startswith(b"HTTP/1.1 200")
        with socket.socket(socket.AF_UNIX) as raw:  # plain HTTP on a TLS socket gets no answer
            raw.settimeout(10)
            raw.connect(str(sock))
            raw.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
            try:
                answer = raw.recv(64)
            except ConnectionResetError:
                answer = b""
            assert not answer.startswith(b"HTTP/")
