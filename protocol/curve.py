"""ZeroMQ CURVE for every kvpool socket: keys from certificate files (`zmq.auth`).

Make certificates with ``python -m protocol.curve DIR NAME``: ``NAME.key`` holds
the public key, to be shared; ``NAME.key_secret`` both keys, to be kept (written
with mode 0600; ``zmq.auth.create_certificates`` alone leaves it world-readable).
The scheduler is the CURVE server: it loads its secret certificate and accepts
only peers whose public certificate lies in its authorized-keys folder. Workers
and clients load their own secret certificate and the scheduler's public one.
"""

from __future__ import annotations

import argparse
import os
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


def create_certificates(folder: str | Path, name: str) -> tuple[Path, Path]:
    """Write ``folder/name.key`` (public, mode 0644) and ``folder/name.key_secret``
    (mode 0600: only its owner may read it). Refuses (CurveKeyError, nothing
    written) when either exists: overwriting a secret key loses it."""
    folder = Path(folder)
    public, secret = folder / f"{name}.key", folder / f"{name}.key_secret"
    for p in (public, secret):
        if p.exists():
            raise CurveKeyError(f"{p} already exists: not overwritten (remove it first to make a new pair)")
    folder.mkdir(parents=True, exist_ok=True)
    # NOTE: zmq.auth writes with the process umask (often 0644, world-readable); a
    # umask of 077 while it writes means the secret is never readable by others,
    # not even for an instant before a chmod.
    old = os.umask(0o077)
    try:
        made_public, made_secret = zmq.auth.create_certificates(folder, name)
    finally:
        os.umask(old)
    os.chmod(made_secret, 0o600)
    os.chmod(made_public, 0o644)
    return Path(made_public), Path(made_secret)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m protocol.curve",
        description="Make a ZeroMQ CURVE key pair for a kvpool process: DIR/NAME.key (the public key, to share: "
        "give the scheduler's to its workers and clients, put theirs in the scheduler's authorized-keys folder) "
        "and DIR/NAME.key_secret (both keys, mode 0600: keep it private). Refuses to overwrite either file.",
    )
    p.add_argument("folder", metavar="DIR", help="folder to write the two files into (made if missing)")
    p.add_argument("name", metavar="NAME", help="the certificate's name, e.g. scheduler, worker, client")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    try:
        public, secret = create_certificates(args.folder, args.name)
    except (CurveKeyError, OSError) as e:
        print(f"python -m protocol.curve: error: {e}", file=sys.stderr)
        return 1
    print(f"public: {public}\nsecret: {secret} (mode 0600: keep it private)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
