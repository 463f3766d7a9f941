"""Fixtures shared by the CPU test modules (each opts in with ``pytest.mark.usefixtures``)."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """These tensors are tiny: intra-op threads only cost (badly so on a busy 2-core machine)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)
