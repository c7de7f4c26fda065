"""Export tests run single-threaded on tiny drafts (helpers in ``export_testlib``)."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    # Tiny tensors on a shared 2-core machine: extra intra-op threads only add synchronisation.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

