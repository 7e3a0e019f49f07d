"""Fixtures shared by the engine's tests."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """torch on one thread for a module's tests: their models are tiny, and one thread is
    several times faster than two on a shared 2-core machine."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
