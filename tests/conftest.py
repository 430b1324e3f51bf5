"""Shared fixtures. Every test names its device: the suite runs the same on a machine with a GPU.

- `device`: the CPU, where every test runs (a GPU machine runs them on its CPU too).
- `@pytest.mark.gpu`: a test of a CUDA path, skipped with a stated reason where there is no CUDA GPU.
"""

import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cpu")
