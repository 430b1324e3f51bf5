"""Shared fixtures. Every test names its device: the suite runs the same on a machine with a GPU.

- `device`: the CPU, where every test runs (a GPU machine runs them on its CPU too).
- `@pytest.mark.gpu`: a test of a CUDA path, skipped with a stated reason where there is no CUDA GPU.
- `one_thread`: torch on one intra-op thread for a module (`pytestmark = pytest.mark.usefixtures("one_thread")`).
- `shapes_train`: 512 synthetic training images (gk.data.shapes, seed 1), built once per run; `small_data`:
  (train, test) of 512 and 128; `corpus`: (train, test) windows of 16 byte tokens of gpukit's own source.
- Shared models and batches (a small GPT, a Hugging Face-style LM, seeded images): tests/helpers.py.
- `fresh_global_state` (autouse): every test starts with Python's, NumPy's and torch's generators seeded
  with 0, and leaves them, torch's threads, default dtype, grad mode and matmul/cuDNN flags as it found
  them: tests pass alone, together and in any order.
- `fake_cuda`: one fake H100 at torch's lowest CUDA layer (tests/fake_cuda.py), undone after the test; other GPUs with
  `@pytest.mark.parametrize("fake_cuda", [[T4, T4]], indirect=True)`. It checks calls and argument handling, not
  numbers.
"""

import random

import numpy as np
import pytest
import torch

from gpukit.data import ImageDataset, shapes
from tests.fake_cuda import H100, FakeCuda


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one)")
    config.addinivalue_line(
        "markers", "slow: runs for tens of seconds or more (a browser, subprocess suites); make unit skips them"
    )


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("gpu") is not None:  # the marker, not a parameter id that reads "gpu"
            item.add_marker(skip)


def _global_state() -> dict:
    """What a test may change behind its own back (CUDA's generator is reseeded by torch.manual_seed; reading
    its state would initialise CUDA here, which forked launches refuse)."""
    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "threads": torch.get_num_threads(),
        "dtype": torch.get_default_dtype(),
        "grad": torch.is_grad_enabled(),
        "matmul": torch.get_float32_matmul_precision(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
        "cudnn": (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32),
        "tf32": torch.backends.cuda.matmul.allow_tf32,
    }


def _restore(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if torch.get_num_threads() != state["threads"]:
        torch.set_num_threads(state["threads"])
    torch.set_default_dtype(state["dtype"])
    torch.set_grad_enabled(state["grad"])
    torch.set_float32_matmul_precision(state["matmul"])
    torch.use_deterministic_algorithms(state["deterministic"])
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic, torch.backends.cudnn.allow_tf32 = state["cudnn"]
    torch.backends.cuda.matmul.allow_tf32 = state["tf32"]


@pytest.fixture(autouse=True)
def fresh_global_state():
    state = _global_state()
    random.seed(0)
    np.random.seed(0)
    torch.manual_seed(0)
    yield
    _restore(state)


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


@pytest.fixture(scope="session")
def small_data() -> tuple[ImageDataset, ImageDataset]:
    """512 training and 128 held-out shapes images (seed 1)."""
    return shapes(512, 128, seed=1)


@pytest.fixture(scope="session")
def corpus():
    """Byte tokens of real text (this package's own source), split into train and held-out windows of 16."""
    import gpukit

    return gpukit.data.text(gpukit.__file__.replace("__init__.py", ""), seq_len=16, max_bytes=40_000, pattern="*.py")


@pytest.fixture
def fake_cuda(request, monkeypatch) -> FakeCuda:
    """A fake CUDA machine (default one H100; `request.param`: a list of FakeGPU) for the test, undone after it.

    It replaces only torch's lowest CUDA layer (C bindings, lazy init, streams, events, NVML), so torch.cuda's own
    functions and argument checks run as on a GPU; it checks calls and argument handling, not numbers. Measured with
    tests/gpu_lines.py (which derives the GPU-only statements from gpukit's source): tests/test_gpu_paths.py executes
    338 of 388 (87%, torch 2.14) — the rest need the real CUDA runtime or worker processes on the GPU (see tests/fake_cuda.py). On a
    machine with a real GPU the fixture patches all the same: the tests see the fake GPU there too.
    """
    return FakeCuda(getattr(request, "param", [H100])).install(monkeypatch)
