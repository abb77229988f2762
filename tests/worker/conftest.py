"""Fixtures of the worker's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def one_thread():
    """torch at one thread for the test, the count it had restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
