"""Fixtures for the method tests."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # These tensors are tiny: intra-op threads only add synchronisation, which on a busy CPU costs far
    # more than the arithmetic (measured: ~70x slower TTT steps with 2 threads on a loaded 2-core box).
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
