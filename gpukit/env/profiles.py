"""Run profiles: the sizes a lesson reads (`tiny` for CI, `cpu` for a laptop, `gpu` for a CUDA GPU), and which one
applies here. Code paths never depend on the profile, only sizes do."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

PROFILE_NAMES = ("tiny", "cpu", "gpu")


@dataclass(frozen=True)
class Profile:
    """Sizes a lesson reads. Code paths never depend on the profile, only sizes do."""

    name: str
    train_size: int  # images in the training set
    test_size: int  # held-out images
    epochs: int
    width: int  # base channel count of the fast CNN
    batch_size: int
    batch_sizes: tuple[int, ...]  # sweep for batch-size lessons
    bench_repeats: int  # timed repeats per measurement
    matmul_size: int  # n for an n×n matmul benchmark
    # The small GPT on byte tokens (gk.models.gpt, gk.data.text):
    text_bytes: int | None  # bytes of the corpus read (None: all of it)
    seq_len: int  # tokens per window
    gpt_width: int
    gpt_depth: int  # transformer blocks
    gpt_heads: int
    gpt_steps: int  # optimizer steps of a lesson's training run


PROFILES = {
    # CI and tests: a 2-core CPU, one training thread; each lesson takes 10 s to about 2.5 minutes of its CPU time.
    "tiny": Profile(
        name="tiny", train_size=8192, test_size=1024, epochs=4, width=8, batch_size=64,
        batch_sizes=(16, 32, 64, 128), bench_repeats=5, matmul_size=512,
        text_bytes=1_000_000, seq_len=64, gpt_width=64, gpt_depth=2, gpt_heads=4, gpt_steps=150,
    ),
    # A laptop without a GPU: minutes per lesson.
    "cpu": Profile(
        name="cpu", train_size=10_240, test_size=2_048, epochs=5, width=12, batch_size=64,
        batch_sizes=(16, 32, 64, 128), bench_repeats=7, matmul_size=1024,
        text_bytes=2_000_000, seq_len=128, gpt_width=96, gpt_depth=3, gpt_heads=4, gpt_steps=300,
    ),
    # Full-size models on a CUDA GPU, with the data and steps cut for a short lease (each lesson's derivation in its
    # setup cell, the seconds in benchmarks/gpu-ledger.json): 20,000 training images (lesson 01: 4 epochs of 78 steps
    # of 256, against tiny's 3 of 128 steps of 64 that pass its 0.8-accuracy check; its batch-1024 runs get 40 steps),
    # 500 GPT steps (lesson 06: held-out loss below the unigram entropy, which tiny's 150 steps reach).
    "gpu": Profile(
        name="gpu", train_size=20_000, test_size=5_000, epochs=10, width=64, batch_size=256,
        batch_sizes=(32, 64, 128, 256, 512, 1024), bench_repeats=20, matmul_size=8192,
        text_bytes=None, seq_len=256, gpt_width=384, gpt_depth=6, gpt_heads=6, gpt_steps=500,
    ),
}  # fmt: skip


def _choose_profile(device: str, cpu_count: int) -> tuple[Profile, str]:
    override = os.environ.get("GPUKIT_PROFILE")
    if override:
        if override not in PROFILES:
            raise ValueError(
                f"GPUKIT_PROFILE={override!r} is not a profile; use one of {', '.join(PROFILE_NAMES)} "
                "or unset it to choose automatically."
            )
        return PROFILES[override], "set by GPUKIT_PROFILE"
    return _automatic_profile(device, cpu_count)


def _automatic_profile(device: str, cpu_count: int) -> tuple[Profile, str]:
    if device == "cuda":
        return PROFILES["gpu"], "a CUDA GPU is present"
    if os.environ.get("CI"):
        return PROFILES["tiny"], "CI is set"
    if cpu_count <= 2:
        return PROFILES["tiny"], f"no usable CUDA GPU and only {cpu_count} CPU cores"
    return PROFILES["cpu"], "no usable CUDA GPU" + (" (MPS uses laptop sizes)" if device == "mps" else "")


def profile_for(device: str | torch.device) -> Profile:
    """The profile for work that runs on `device` here.

    Sizes follow the device that does the work: a lesson that trains in CPU worker processes
    on a machine with one GPU sizes them as this machine's CPU profile, not the GPU's.
    GPUKIT_PROFILE still decides when set, except that `gpu` sizes are for CUDA devices only:
    under GPUKIT_PROFILE=gpu, work on the CPU gets this machine's own choice for the CPU (`cpu`,
    or `tiny` with at most 2 cores). On an H100 host (16 cores), lesson 04's CPU ranks at gpu sizes
    (1 GiB gloo all-reduces, width-64 CNNs) ran past a cell's 240 s; at cpu sizes they take about 30 s.
    """
    kind, cpu_count = torch.device(device).type, os.cpu_count() or 1
    profile, _ = _choose_profile(kind, cpu_count)
    if profile.name == "gpu" and kind != "cuda":
        profile, _ = _automatic_profile(kind, cpu_count)
    return profile
