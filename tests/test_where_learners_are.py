"""The machines learners have: a T4 (no bf16, 16 GB; Kaggle gives two), Apple silicon, a laptop's CPU.

The GPUs are the fake ones of tests/fake_cuda.py (calls and argument handling, not numbers); MPS is faked by making
torch report it available, with every CUDA entry point made to fail, so that reaching one fails the test.
"""

from __future__ import annotations

import pytest
import torch

import gpukit as gk
from gpukit.precision import get_precision
from tests.fake_cuda import T4, GiB

two_t4 = pytest.mark.parametrize("fake_cuda", [[T4, T4]], indirect=True, ids=["2xT4"])


@pytest.fixture
def automatic_profile(monkeypatch):
    for variable in ("GPUKIT_PROFILE", "CI"):
        monkeypatch.delenv(variable, raising=False)


@two_t4
def test_kaggles_two_t4s_train_in_fp16_with_loss_scaling(fake_cuda, automatic_profile):
    env = gk.detect()
    assert (env.device, env.gpu_count, env.profile.name) == ("cuda", 2, "gpu")
    assert not env.bf16 and not env.tf32  # compute capability 7.5
    assert env.fast_precision == "fp16-mixed"
    precision = get_precision(env.fast_precision, "cuda")
    assert precision.scaler.is_enabled()  # fp16 without loss scaling loses small gradients (lesson 01)
    with pytest.raises(ValueError, match="fp16-mixed"):  # bf16 refused, naming what to use instead
        get_precision("bf16-mixed", "cuda")


def test_an_h100_trains_in_bf16(fake_cuda, automatic_profile):  # the fixture's default GPU
    env = gk.detect()
    assert env.bf16 and env.fast_precision == "bf16-mixed"


def test_the_gpu_profiles_largest_runs_fit_a_t4():
    """The lessons' largest models at the gpu profile's largest batches, predicted in fp16 (the T4's precision),
    with room to spare in a T4's 16 GB: the CNN at the largest batch of the batch-size sweep, the GPT of lesson 06."""
    profile = gk.PROFILES["gpu"]
    batch = max(profile.batch_sizes)
    cnn = gk.memory.estimate(
        gk.models.fast_cnn(profile.width),
        torch.zeros(batch, 3, 32, 32),
        torch.zeros(batch, dtype=torch.long),
        precision="fp16-mixed",
        device="cpu",
    )
    model = gk.models.gpt(
        max_seq_len=profile.seq_len, width=profile.gpt_width, depth=profile.gpt_depth, heads=profile.gpt_heads
    )
    tokens = torch.zeros(64, profile.seq_len, dtype=torch.long)  # lesson 06's GPT_BATCH in the gpu profile
    gpt = gk.memory.estimate(model, (tokens, tokens), optimizer="adamw", precision="fp16-mixed", device="cpu")
    for name, prediction in {"CNN": cnn, "GPT": gpt}.items():
        assert prediction.total < T4.total_memory / 4, (name, gk.format_bytes(prediction.total))
    assert T4.total_memory == 16 * GiB


@pytest.fixture
def fake_mps(monkeypatch, automatic_profile):
    """torch says MPS is available; any CUDA call fails the test."""
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: True)
    monkeypatch.setattr(torch.backends.mps, "is_built", lambda: True)

    def no_cuda(*args, **kwargs):
        raise AssertionError("a CUDA call was reached on an MPS machine")

    for name in (
        "is_available",
        "device_count",
        "get_device_properties",
        "synchronize",
        "mem_get_info",
        "max_memory_allocated",
        "reset_peak_memory_stats",
        "get_device_capability",
    ):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    monkeypatch.setattr(gk.env, "_cuda_survey", lambda: gk.env._Survey([], ""))  # a child process would ask CUDA


def test_apple_silicon_gets_mps_laptop_sizes_and_fp32(fake_mps):
    env = gk.detect()
    assert env.device == "mps" and env.gpu_count == 0
    assert env.profile.name == ("tiny" if env.cpu_count <= 2 else "cpu")  # laptop sizes, never the gpu profile
    assert env.fast_precision == "fp32"
    assert gk.resolve_device(None) == torch.device("mps")
