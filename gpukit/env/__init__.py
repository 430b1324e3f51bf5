"""Device detection, seeding and run profiles.

Detection never initialises CUDA in the calling process: it asks NVML (the driver's
management library) instead of the CUDA runtime, so a notebook can still fork worker
processes that use the GPU afterwards. NVML knows neither CUDA_VISIBLE_DEVICES nor what
torch was built for, so detection applies both itself: the GPUs CUDA would show, and whether
this torch's CUDA version can run on the driver. Where NVML cannot tell which GPUs CUDA shows
(its Python binding is missing, MIG instances, GPUs of different models), a short-lived child
process asks CUDA, which initialises CUDA there and not here.

profiles.py    the run profiles (tiny, cpu, gpu) and which applies here; `profile_for(device)`
gpu_survey.py  which GPUs CUDA will show this process (NVML, CUDA_VISIBLE_DEVICES, or a child process)
cuda_build.py  can this torch run on this driver: `cuda_build_problem`
threads.py     the CPU threads to compute and time with: `cpu_threads`
__init__.py    `detect()` and its `Env`, `resolve_device`, `cuda_index`, `synchronize`, `seed_everything`
"""

from __future__ import annotations

import os
import random
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
import torch

from ..validation import check_seed
from .cuda_build import cuda_build_problem
from .gpu_survey import GPUInfo, _cuda_survey, ask_nvml, nvml_cuda_version
from .profiles import PROFILE_NAMES, PROFILES, Profile, _choose_profile, profile_for
from .threads import cpu_load, cpu_threads, usable_cpus

__all__ = [
    "PROFILES",
    "PROFILE_NAMES",
    "Env",
    "GPUInfo",
    "Profile",
    "as_dict",
    "ask_nvml",
    "cpu_load",
    "cpu_threads",
    "cuda_build_problem",
    "cuda_index",
    "detect",
    "nvml_cuda_version",
    "profile_for",
    "resolve_device",
    "seed_everything",
    "synchronize",
    "usable_cpus",
]


@dataclass
class Env:
    """What this machine offers, found without initialising CUDA."""

    device: str  # "cuda", "mps" or "cpu": the best device torch can use here
    gpu_count: int  # CUDA GPUs torch can use: len(gpus), or 0 when cuda_unusable_reason says why not
    gpus: list[GPUInfo] = field(default_factory=list)  # NVIDIA GPUs CUDA shows this process, usable or not
    bf16: bool = False  # bf16 autocast supported on `device`
    tf32: bool = False  # TF32 tensor-core matmuls available (CUDA, compute capability >= 8.0)
    cpu_count: int = 1
    profile: Profile = PROFILES["tiny"]
    profile_reason: str = ""
    cuda_unusable_reason: str = ""  # why torch cannot use `gpus` here and what to install; "" when it can
    # The intra-op threads CPU work should run and be timed with here (cpu_threads), and why. detect() never applies
    # it: a lesson's setup cell calls torch.set_num_threads(env.threads) and prints it.
    threads: int = 1
    threads_reason: str = ""

    @property
    def has_gpu(self) -> bool:
        return self.device in ("cuda", "mps")

    @property
    def fast_precision(self) -> str:
        """The precision that trains fastest here, for `fit(precision=...)`: "bf16-mixed" on CUDA GPUs with bf16
        (compute capability 8.0 and newer), "fp16-mixed" with loss scaling on older ones (a T4 or a V100: their
        tensor cores run fp16, not bf16), and "fp32" on CPUs and MPS, where bf16 is emulated or no faster."""
        if self.device != "cuda":
            return "fp32"
        return "bf16-mixed" if self.bf16 else "fp16-mixed"

    def __str__(self) -> str:
        gpus = ", ".join(g.name for g in self.gpus) or "none"
        if self.cuda_unusable_reason:
            gpus += f"; not usable: {self.cuda_unusable_reason}"
        return (
            f"device={self.device} gpus={self.gpu_count} ({gpus}) bf16={self.bf16} tf32={self.tf32} "
            f"cpus={self.cpu_count} threads={self.threads} profile={self.profile.name} ({self.profile_reason})"
        )


_explained: set[str] = set()  # problems detect() has printed once in this process


def _explain_once(gpus: list[GPUInfo], problem: str) -> None:
    if problem and problem not in _explained:
        _explained.add(problem)
        names = ", ".join(gpu.name for gpu in gpus)
        print(f"gpukit.detect(): using the CPU, not the GPU(s) here ({names}), because {problem}.", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# This machine, its device, and seeding


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def detect() -> Env:
    """Describe this machine and pick the run profile, without initialising CUDA.

    The device is "cuda" when CUDA shows this process a GPU (CUDA_VISIBLE_DEVICES counts) and this torch
    can run on its driver; otherwise the GPUs stay listed, `cuda_unusable_reason` says why, and one line
    printed per process says what to install. The profile is `gpu` with a usable CUDA GPU, `tiny` on CI
    or a machine with at most 2 cores, and `cpu` otherwise; GPUKIT_PROFILE overrides the choice.
    """
    survey = _cuda_survey()
    gpus, problem = survey.gpus, survey.problem
    cpu_count = os.cpu_count() or 1
    if gpus and not problem:
        device = "cuda"
        ampere = all(g.compute_capability is not None and g.compute_capability >= (8, 0) for g in gpus)
        bf16, tf32 = ampere, ampere
    elif _mps_available():
        device, bf16, tf32 = "mps", True, False
    else:
        device, bf16, tf32 = "cpu", True, False  # CPU autocast supports bfloat16
    _explain_once(gpus, problem)
    profile, reason = _choose_profile(device, cpu_count)
    gpu_count = len(gpus) if device == "cuda" else 0
    threads, threads_reason = cpu_threads(usable_cpus(), cpu_load(), torch.get_num_threads())
    return Env(
        device,
        gpu_count,
        gpus,
        bf16,
        tf32,
        cpu_count,
        profile,
        reason,
        cuda_unusable_reason=problem,
        threads=threads,
        threads_reason=threads_reason,
    )


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Turn None (best available), "cuda", "cuda:1", "cpu", … into a checked torch.device."""
    if device is None:
        return torch.device(detect().device)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'mps'.") from error
    if device.type == "cuda":
        survey = _cuda_survey()
        if survey.problem:
            raise ValueError(
                f"device='{device}' was asked for but torch cannot use the GPU here: {survey.problem}. "
                "Until then use device='cpu'."
            )
        count = len(survey.gpus)
        if count == 0:
            hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={hidden!r} chooses the GPUs it sees)" if hidden is not None else ""
            raise ValueError(
                f"device='{device}' was asked for but this process sees no CUDA GPU{why}; use device='cpu'."
            )
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device='{device}' does not exist: this process sees {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}."
            )
    elif device.type == "mps" and not _mps_available():
        raise ValueError("device='mps' was asked for but MPS is not available here; use device='cpu'.")
    elif device.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device type {device.type!r} is not supported by gpukit; use 'cpu', 'cuda' or 'mps'.")
    return device


def cuda_index(device: str | torch.device | None = None) -> int:
    """The index of a CUDA device: "cuda:1" → 1; "cuda" (or None) → the current device.

    Some torch.cuda functions (get/set_per_process_memory_fraction, set_device) refuse torch.device("cuda")
    without an index while the others accept it; gpukit turns a device into an index here before calling them.
    Never initialises CUDA: until it is initialised (torch.cuda.set_device does), the current device is 0.
    """
    device = torch.device(device if device is not None else "cuda")
    if device.type != "cuda":
        raise ValueError(f"{device} is not a CUDA device; pass 'cuda' or 'cuda:N'.")
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if torch.cuda.is_initialized() else 0


def synchronize(device: torch.device | str | None) -> None:
    """Wait for all queued work on `device` (no-op on CPU): before reading a clock, or a GPU's memory counters."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so that a run can be repeated. `seed`: an integer in
    gk.validation.SEED_RANGE (0..2**32-1), Python's or NumPy's."""
    seed = check_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily, without initialising CUDA


def as_dict(env: Env) -> dict:
    return asdict(env)
