"""Shared test set-up: makes tests/kvtest (test helpers) importable; Triton interprets on CPU."""

import os
import sys
from pathlib import Path

import torch

# The Triton kernels of CUDA's paged attention run in Triton's CPU interpreter where there
# is no GPU (read when a kernel is defined, so before any test imports one).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

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


@pytest.fixture(scope="session")
def real_vllm(request):
    """The repository root, once vLLM's venv is there and ``-m compare`` asked for it:
    the ``compare``-marked tests run vLLM itself (``make compare`` installs
    ``.venv-vllm``), for minutes, so never in CI and never unless selected."""
    root = Path(__file__).resolve().parents[1]
    if not (root / ".venv-vllm/bin/vllm").exists():
        pytest.skip("no .venv-vllm (make compare installs it)")
    if "compare" not in (request.config.getoption("-m") or ""):
        pytest.skip("runs vLLM for minutes: select it with -m compare")
    return root


def pytest_collection_modifyitems(items):
    """schemathesis 4.32 names each operation's item ``test[GET /path]``, but pytest 9.2 builds
    a node id from the function's original name and a parametrize call's id only, so every
    operation of a schema shares one id and pytest-xdist, which finds items by id, runs the
    wrong ones. Give each the operation as its parameter."""
    for item in items:
        label = getattr(item, "operation_label", None)
        if label is not None and not item.nodeid.endswith("]"):
            item._id = item._id.with_params(label)
