"""Shared test set-up: makes tests/kvtest (test helpers) importable."""

import sys
from pathlib import Path

_TESTS = str(Path(__file__).resolve().parent)
if _TESTS not in sys.path:
    sys.path.insert(0, _TESTS)


import pytest  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _kvpool_cache_dir(tmp_path_factory):
    """Every worker a test starts generates the tiny default checkpoint into this
    session's own cache folder, not the user's ~/.cache/kvpool."""
    import os

    path = str(tmp_path_factory.mktemp("kvpool-cache"))
    old = os.environ.get("KVPOOL_CACHE_DIR")
    os.environ["KVPOOL_CACHE_DIR"] = path
    yield path
    if old is None:
        os.environ.pop("KVPOOL_CACHE_DIR", None)
    else:
        os.environ["KVPOOL_CACHE_DIR"] = old


@pytest.fixture(scope="session")
def tiny_checkpoint(_kvpool_cache_dir):
    """The directory of the tiny default checkpoint (what `python -m worker` serves)."""
    from worker.tiny.generate import default_checkpoint

    return default_checkpoint()


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    """transformers' model of the tiny default checkpoint, in float64."""
    import torch
    from kvtest.hf_models import load_reference

    return load_reference(tiny_checkpoint, torch.float64)
