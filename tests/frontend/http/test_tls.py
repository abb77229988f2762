"""--ssl-keyfile / --ssl-certfile / --ssl-ca-certs / --ssl-cert-reqs, as uvicorn serves
vLLM: HTTPS with the given chain, client certificates checked as ssl.CERT_* asks.
Certificates made in the test with `openssl` (a CA, a server certificate for
127.0.0.1, a client certificate); the openai SDK trusts the CA."""

from __future__ import annotations

import shutil
import socket
import ssl
import subprocess
import urllib.error
import urllib.request
from pathlib import Path

import openai
import pytest
from kvtest.fake_engine import fake_engine, frontend_process
from kvtest.serve import kvpool_serve

pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("certs")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvpool test CA", cwd=d)
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name in ("server", "client"):
        _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
        ext = ["-extfile", "server.ext"] if name == "server" else []
        _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
                 "-days", "2", *ext, cwd=d)
    return d


def tls_flags(certs: Path, *extra: str) -> tuple[str, ...]:
    return ("--ssl-certfile", str(certs / "server.pem"), "--ssl-keyfile", str(certs / "server.key"), *extra)


def client_context(certs: Path, with_cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(certs / "ca.pem"))
    if with_cert:
        ctx.load_cert_chain(str(certs / "client.pem"), str(certs / "client.key"))
    return ctx


def test_https_with_the_sdk_trusting_the_ca(tiny_checkpoint, certs, tmp_path):
    model = str(tiny_checkpoint)
    with fake_engine() as engine, frontend_process(model, engine, tmp_path / "f.log", *tls_flags(certs), scheme="https") as f:
        http = openai.DefaultHttpxClient(verify=client_context(certs))
        client = openai.OpenAI(base_url=f.base_url + "/v1", api_key="unused", max_retries=0, timeout=30, http_client=http)
        assert client.completions.create(model=model, prompt="hello", max_tokens=3).usage.completion_tokens == 3
        # An untrusting client fails the handshake; plain HTTP on the port gets no answer.
        with pytest.raises(urllib.error.URLError) as e:
            urllib.request.urlopen(f.base_url + "/health", timeout=10, context=ssl.create_default_context())
        assert isinstance(e.value.reason, ssl.SSLCertVerificationError)
        with pytest.raises((urllib.error.URLError, ConnectionError)):
            urllib.request.urlopen(f"http://127.0.0.1:{f.port}/health", timeout=10)
        assert "on https://127.0.0.1:" in f.output()


def test_a_required_client_certificate(tiny_checkpoint, certs, tmp_path):
    flags = tls_flags(certs, "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)))
    probe = client_context(certs, with_cert=True)
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", *flags, scheme="https", probe_context=probe) as f:
        with urllib.request.urlopen(f.base_url + "/health", timeout=10, context=client_context(certs, with_cert=True)) as r:
            assert r.status == 200
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(f.base_url + "/health", timeout=10, context=client_context(certs))


def test_a_bad_certificate_stops_the_start_naming_the_file(tiny_checkpoint, certs, tmp_path):
    missing = tmp_path / "nope.pem"
    with fake_engine() as engine, pytest.raises(RuntimeError) as e:
        with frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", "--ssl-certfile", str(missing), scheme="https"):
            pass
    assert f"cannot load --ssl-certfile {missing}" in str(e.value)


def _handshake(port: int, ctx: ssl.SSLContext) -> tuple[str, str]:
    """(TLS version, cipher) a client of ``ctx`` negotiates with 127.0.0.1:port."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as raw, ctx.wrap_socket(raw, server_hostname="127.0.0.1") as s:
        name, version, _bits = s.cipher()
        return version, name


def test_ssl_ciphers_limits_tls12_to_the_given_suites(tiny_checkpoint, certs, tmp_path):
    chosen, other = "ECDHE-RSA-AES128-GCM-SHA256", "ECDHE-RSA-AES256-GCM-SHA384"
    with fake_engine() as engine, frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", *tls_flags(certs, "--ssl-ciphers", chosen),
                                                   scheme="https") as f:
        tls12 = client_context(certs)
        tls12.maximum_version = ssl.TLSVersion.TLSv1_2
        assert _handshake(f.port, tls12) == ("TLSv1.2", chosen)  # the client offers every default suite
        tls12.set_ciphers(other)
        with pytest.raises(ssl.SSLError):
            _handshake(f.port, tls12)
        # TLS 1.3's suites are not OpenSSL's cipher list: a TLS 1.3 client still connects.
        assert _handshake(f.port, client_context(certs))[0] == "TLSv1.3"


def test_ssl_ciphers_selecting_none_stops_the_start_naming_it(tiny_checkpoint, certs, tmp_path):
    with fake_engine() as engine, pytest.raises(RuntimeError) as e:
        with frontend_process(tiny_checkpoint, engine, tmp_path / "f.log", *tls_flags(certs, "--ssl-ciphers", "NO-SUCH-CIPHER"), scheme="https"):
            pass
    assert "--ssl-ciphers 'NO-SUCH-CIPHER' selects no cipher" in str(e.value)


def test_kvpool_serve_gets_ready_though_the_frontend_requires_client_certificates(tiny_checkpoint, certs, tmp_path):
    flags = tls_flags(certs, "--ssl-ca-certs", str(certs / "ca.pem"), "--ssl-cert-reqs", str(int(ssl.CERT_REQUIRED)))
    with kvpool_serve(tiny_checkpoint, tmp_path / "logs", *flags, ready_timeout=60) as s:
        assert f"ready at https://127.0.0.1:{s.port}/v1" in s.ready_line
        url = f"https://127.0.0.1:{s.port}/health"
        with urllib.request.urlopen(url, timeout=10, context=client_context(certs, with_cert=True)) as r:
            assert r.status == 200
        with pytest.raises((urllib.error.URLError, ssl.SSLError, ConnectionError)):
            urllib.request.urlopen(url, timeout=10, context=client_context(certs))
