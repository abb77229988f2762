"""`python -m protocol.curve`: the secret certificate is readable by its owner only."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import zmq.auth

from protocol.curve import CurveKeyError, create_certificates, load_keypair, main


@pytest.fixture
def permissive_umask():
    old = os.umask(0o022)  # the common default: new files world-readable
    try:
        yield
    finally:
        os.umask(old)


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_secret_is_written_0600_and_the_public_key_0644(tmp_path: Path, permissive_umask, capsys):
    folder = tmp_path / "keys"
    assert main([str(folder), "scheduler"]) == 0
    secret, public = folder / "scheduler.key_secret", folder / "scheduler.key"
    assert mode(secret) == 0o600 and mode(public) == 0o644
    assert os.umask(0o022) == 0o022  # the process umask is left as it was
    assert "0600" in capsys.readouterr().out
    # A usable pair: the public key in both files is the same.
    assert load_keypair(secret)[0] == load_keypair(public, need_secret=False)[0]


def test_an_existing_pair_is_not_overwritten(tmp_path: Path, permissive_umask, capsys):
    zmq.auth.create_certificates(tmp_path, "w")
    before = (tmp_path / "w.key_secret").read_bytes()
    with pytest.raises(CurveKeyError, match="already exists"):
        create_certificates(tmp_path, "w")
    assert main([str(tmp_path), "w"]) == 1
    assert "already exists" in capsys.readouterr().err
    assert (tmp_path / "w.key_secret").read_bytes() == before


def test_help_says_what_it_writes(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "usage: python -m protocol.curve" in out and "DIR/NAME.key_secret" in out and "0600" in out


def test_a_missing_name_is_a_usage_error_that_writes_nothing(tmp_path: Path, capsys):
    with pytest.raises(SystemExit) as e:
        main([str(tmp_path / "keys")])
    assert e.value.code == 2
    assert "NAME" in capsys.readouterr().err
    assert not (tmp_path / "keys").exists()
