"""Certificates for TLS tests, made with the `openssl` command: a CA, and certificates
it signs (a server's names 127.0.0.1 and localhost)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def make_ca(d: Path) -> Path:
    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "2", "-subj", "/CN=kvpool test CA", cwd=d)
    return d / "ca.pem"


def make_server_cert(d: Path, name: str, cn: str) -> tuple[Path, Path]:
    """(NAME.pem, NAME.key) for 127.0.0.1, with subject CN=cn, signed by d's CA."""
    (d / "server.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}", cwd=d)
    openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial", "-out", f"{name}.pem",
            "-days", "2", "-extfile", "server.ext", cwd=d)
    return d / f"{name}.pem", d / f"{name}.key"
