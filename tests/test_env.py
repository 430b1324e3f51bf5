"""Device detection, run profiles, devices and seeding: none of it may initialise CUDA here."""

from __future__ import annotations

import multiprocessing
import queue
import random

import numpy as np
import pytest
import torch

import gpukit
from gpukit import env
from gpukit.env import PROFILE_NAMES, PROFILES

HAS_CUDA_GPU = gpukit.detect().device == "cuda"  # asks NVML, not the CUDA runtime


@pytest.fixture
def forbid_cuda_init(monkeypatch):
    """Make any CUDA initialisation in this process fail loudly, and forget cached GPU facts."""

    def fail(*args, **kwargs):
        raise AssertionError("CUDA was initialised in the calling process")

    monkeypatch.setattr(torch.cuda, "_lazy_init", fail)
    monkeypatch.setattr(env, "_cached_gpus", None)  # make detect() ask NVML (or the child) again


def test_detect_returns_a_profile():
    found = gpukit.detect()
    assert found.device in ("cuda", "mps", "cpu")
    assert found.profile in PROFILES.values()
    assert found.profile_reason
    assert found.cpu_count >= 1
    assert found.gpu_count == len(found.gpus)


@pytest.mark.parametrize("name", PROFILE_NAMES)
def test_profile_override(monkeypatch, name):
    monkeypatch.setenv("GPUKIT_PROFILE", name)
    found = gpukit.detect()
    assert found.profile is PROFILES[name]
    assert "GPUKIT_PROFILE" in found.profile_reason


def test_bad_profile_override_names_the_choices(monkeypatch):
    monkeypatch.setenv("GPUKIT_PROFILE", "huge")
    with pytest.raises(ValueError, match="huge") as error:
        gpukit.detect()
    for name in PROFILE_NAMES:
        assert name in str(error.value)


def test_detect_does_not_initialise_cuda(forbid_cuda_init):
    gpukit.detect()
    assert not torch.cuda.is_initialized()


def test_doctor_does_not_initialise_cuda(forbid_cuda_init):
    gpukit.doctor()
    assert not torch.cuda.is_initialized()


def _child_work(results) -> None:
    # Runs in a forked child: it must be able to use torch after the parent called detect().
    torch.set_num_threads(1)  # OpenMP thread pools do not survive fork; one thread needs none
    x = torch.arange(16.0).reshape(4, 4)
    results.put(float((x @ x).sum()))


def test_fork_after_detect_can_use_torch():
    gpukit.detect()
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    child = context.Process(target=_child_work, args=(results,))
    child.start()
    try:
        result = results.get(timeout=60)  # seconds; a hung child fails the test instead of hanging it
    except queue.Empty:
        pytest.fail("the forked child did not report back within 60 s")
    finally:
        child.join(timeout=10)
        if child.is_alive():
            child.kill()
            child.join(timeout=10)
    x = torch.arange(16.0).reshape(4, 4)
    assert result == float((x @ x).sum())
    assert child.exitcode == 0


@pytest.mark.skipif(HAS_CUDA_GPU, reason="this machine has a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:7"])
def test_resolve_cuda_without_gpu_says_use_cpu(device):
    with pytest.raises(ValueError, match="'cpu'"):
        gpukit.resolve_device(device)


def test_resolve_unknown_device():
    with pytest.raises(ValueError, match="banana"):
        gpukit.resolve_device("banana")


def test_resolve_cpu_and_default():
    assert gpukit.resolve_device("cpu") == torch.device("cpu")
    assert gpukit.resolve_device(None).type == gpukit.detect().device


def test_seed_everything_repeats_random_numbers():
    def draw():
        return torch.randn(5), np.random.rand(3), random.random()

    gpukit.seed_everything(123)
    first = draw()
    gpukit.seed_everything(123)
    second = draw()
    assert torch.equal(first[0], second[0])
    assert np.array_equal(first[1], second[1])
    assert first[2] == second[2]
    gpukit.seed_everything(124)
    assert not torch.equal(first[0], torch.randn(5))


def test_sizes_follow_the_device_that_does_the_work(monkeypatch):
    """A lesson's CPU worker processes on a GPU machine get this CPU's profile, not the GPU's."""
    import gpukit.env

    monkeypatch.delenv("GPUKIT_PROFILE", raising=False)
    monkeypatch.delenv("CI", raising=False)
    monkeypatch.setattr(gpukit.env.os, "cpu_count", lambda: 16)
    assert gpukit.env.profile_for("cuda").name == "gpu"
    assert gpukit.env.profile_for("cpu").name == "cpu"
    monkeypatch.setattr(gpukit.env.os, "cpu_count", lambda: 2)
    assert gpukit.env.profile_for(torch.device("cpu")).name == "tiny"
    monkeypatch.setenv("GPUKIT_PROFILE", "gpu")  # a profile set by hand still decides
    assert gpukit.env.profile_for("cpu").name == "gpu"
