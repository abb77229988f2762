"""ZeroMQ CURVE for every kvpool socket: keys from certificate files (`zmq.auth`).

Make certificates with ``python -m protocol.curve DIR NAME`` (or
``zmq.auth.create_certificates``): ``NAME.key`` holds the public key, to be shared;
``NAME.key_secret`` both keys, to be kept. The scheduler is the CURVE server: it
loads its secret certificate and accepts only peers whose public certificate lies
in its authorized-keys folder. Workers and clients load their own secret
certificate and the scheduler's public one.
"""

from __future__ import annotations

import sys
from pathlib import Path

import zmq
import zmq.auth


class CurveKeyError(ValueError):
    """A certificate file that is missing or holds no usable key."""


def load_keypair(path: str | Path, need_secret: bool = True) -> tuple[bytes, bytes | None]:
    p = Path(path)
    if not p.is_file():
        raise CurveKeyError(f"CURVE certificate {p} does not exist")
    try:
        public, secret = zmq.auth.load_certificate(p)
    except (ValueError, OSError) as e:
        raise CurveKeyError(f"CURVE certificate {p} is unreadable: {e}") from None
    if need_secret and not secret:
        raise CurveKeyError(f"CURVE certificate {p} holds no secret key (use the .key_secret file)")
    return public, secret


def apply_server(sock: zmq.Socket, secret_cert: str | Path) -> None:
    """Make ``sock`` a CURVE server (call before bind)."""
    public, secret = load_keypair(secret_cert)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def apply_client(sock: zmq.Socket, own_secret_cert: str | Path, server_public_cert: str | Path) -> None:
    """Make ``sock`` a CURVE client of the server whose public certificate is given
    (call before connect)."""
    public, secret = load_keypair(own_secret_cert)
    server_public, _ = load_keypair(server_public_cert, need_secret=False)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_serverkey = server_public


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m protocol.curve DIR NAME   (writes DIR/NAME.key and DIR/NAME.key_secret)", file=sys.stderr)
        return 2
    folder = Path(args[0])
    folder.mkdir(parents=True, exist_ok=True)
    public, secret = zmq.auth.create_certificates(folder, args[1])
    print(f"public: {public}\nsecret: {secret}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
