"""Fixtures of the external KV tier's tests: a real ``mooncake_master`` on loopback, with
a store server (``mooncake_client``) holding the memory or none.

A test that asks for a master is skipped only when the ``mooncake`` package cannot be
imported (the ``mooncake`` extra is not installed, or its libraries -- Debian's
libibverbs1, librdmacm1 -- are missing); a master that fails to start is an error.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from kvtest.ports import free_port

from bench.external_store_io import MooncakeMaster


def _need_mooncake() -> None:
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        pytest.skip(f"the mooncake package cannot be imported (pip install 'kvpool[mooncake]'): {e}")


def _run_master(log_dir: Path, store_bytes: int) -> Iterator[MooncakeMaster]:
    _need_mooncake()
    ports = (free_port(), free_port(), free_port(), free_port())
    with MooncakeMaster(log_dir, ports, store_bytes=store_bytes) as master:
        yield master


@pytest.fixture
def needs_mooncake() -> None:
    """Skips the test when the mooncake package cannot be imported."""
    _need_mooncake()


@pytest.fixture(scope="module")
def mooncake_master(tmp_path_factory) -> Iterator[MooncakeMaster]:
    """A master and a store server lending it 64 MiB, shared by a test module, both
    stopped (their process groups killed) after it."""
    yield from _run_master(tmp_path_factory.mktemp("mooncake"), 64 << 20)


@pytest.fixture
def own_mooncake_master(tmp_path) -> Iterator[MooncakeMaster]:
    """A master of the test's own and no memory (no store server), which the test may
    stop (``master.stop()``) midway."""
    yield from _run_master(tmp_path, 0)
