"""Shared fixtures. Every test names its device: the suite runs the same on a machine with a GPU.

- `device`: the CPU, where every test runs (a GPU machine runs them on its CPU too).
- `@pytest.mark.gpu`: a test of a CUDA path, skipped with a stated reason where there is no CUDA GPU.
- `one_thread`: torch on one intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`).
- `shapes_train`: 512 synthetic training images (gk.data.shapes, seed 1), built once per run.
- `fake_cuda`: one fake H100 at torch's lowest CUDA layer (tests/fake_cuda.py), undone after the test; other GPUs with
  `@pytest.mark.parametrize("fake_cuda", [[T4, T4]], indirect=True)`. It checks calls and argument handling, not
  numbers.
"""

import pytest
import torch
from fake_cuda import H100, FakeCuda  # tests/ is on sys.path (pytest's rootdir-relative import)

from gpukit.data import ImageDataset, shapes


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


@pytest.fixture(scope="module")
def one_thread():
    """For tests that count bytes or compare exactly, not seconds, on tiny tensors: on a shared 2-core
    machine with one core busy, two-thread kernels wait on each other (10x slower); one thread avoids it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def shapes_train() -> ImageDataset:
    return shapes(512, 0, seed=1)[0]


@pytest.fixture
def fake_cuda(request, monkeypatch) -> FakeCuda:
    """A fake CUDA machine (default one H100; `request.param`: a list of FakeGPU) for the test, undone after it.

    It replaces only torch's lowest CUDA layer (C bindings, lazy init, streams, events, NVML), so torch.cuda's own
    functions and argument checks run as on a GPU; it checks calls and argument handling, not numbers. Measured with
    tests/gpu_lines.py: tests/test_gpu_paths.py executes 242 of gpukit's 265 GPU-only statements (91%; CUDA-only 170
    of 181) — the rest need the real CUDA runtime or worker processes on the GPU (see tests/fake_cuda.py). On a
    machine with a real GPU the fixture patches all the same: the tests see the fake GPU there too.
    """
    return FakeCuda(getattr(request, "param", [H100])).install(monkeypatch)
