"""Device detection, seeding and run profiles.

Detection never initialises CUDA in the calling process: it asks NVML (the driver's
management library) instead of the CUDA runtime, so a notebook can still fork worker
processes that use the GPU afterwards. Only when NVML's Python binding is missing does it
ask a short-lived child process, which initialises CUDA there and not here.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from dataclasses import asdict, dataclass, field

import numpy as np
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
    # CI and tests: a 2-core CPU, each notebook well under 90 s.
    "tiny": Profile("tiny", 8192, 1024, 4, 8, 64, (16, 32, 64, 128), 5, 512,
                    text_bytes=1_000_000, seq_len=64, gpt_width=64, gpt_depth=2, gpt_heads=4, gpt_steps=150),
    # A laptop without a GPU: minutes per lesson.
    "cpu": Profile("cpu", 20_000, 5_000, 8, 32, 128, (16, 32, 64, 128, 256), 10, 1024,
                   text_bytes=4_000_000, seq_len=128, gpt_width=128, gpt_depth=4, gpt_heads=4, gpt_steps=600),
    # Full size on a CUDA GPU.
    "gpu": Profile("gpu", 50_000, 10_000, 10, 64, 256, (32, 64, 128, 256, 512, 1024), 20, 8192,
                   text_bytes=None, seq_len=256, gpt_width=384, gpt_depth=6, gpt_heads=6, gpt_steps=2000),
}  # fmt: skip


@dataclass
class GPUInfo:
    index: int
    name: str
    memory_bytes: int
    compute_capability: tuple[int, int] | None


@dataclass
class Env:
    """What this machine offers, found without initialising CUDA."""

    device: str  # "cuda", "mps" or "cpu": the best device present
    gpu_count: int
    gpus: list[GPUInfo] = field(default_factory=list)
    bf16: bool = False  # bf16 autocast supported on `device`
    tf32: bool = False  # TF32 tensor-core matmuls available (CUDA, compute capability >= 8.0)
    cpu_count: int = 1
    profile: Profile = PROFILES["tiny"]
    profile_reason: str = ""

    @property
    def has_gpu(self) -> bool:
        return self.device in ("cuda", "mps")

    def __str__(self) -> str:
        gpus = ", ".join(g.name for g in self.gpus) or "none"
        return (
            f"device={self.device} gpus={self.gpu_count} ({gpus}) bf16={self.bf16} tf32={self.tf32} "
            f"cpus={self.cpu_count} profile={self.profile.name} ({self.profile_reason})"
        )


def _gpus_from_nvml() -> list[GPUInfo] | None:
    """GPUs as NVML sees them, or None if NVML cannot be used here."""
    try:
        import pynvml  # provided by the nvidia-ml-py package (extra "gpu")
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # binding present, no driver: no NVIDIA GPU
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            name = name.decode() if isinstance(name, bytes) else name
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle).total
            try:
                capability = tuple(pynvml.nvmlDeviceGetCudaComputeCapability(handle))
            except pynvml.NVMLError:
                capability = None
            gpus.append(GPUInfo(index, name, int(memory), capability))
        return gpus
    finally:
        pynvml.nvmlShutdown()


_PROBE = (
    "import json, torch\n"
    "gpus = []\n"
    "if torch.cuda.is_available():\n"
    "    for i in range(torch.cuda.device_count()):\n"
    "        p = torch.cuda.get_device_properties(i)\n"
    "        gpus.append([i, p.name, p.total_memory, [p.major, p.minor]])\n"
    "print(json.dumps(gpus))\n"
)


def _gpus_from_child_process() -> list[GPUInfo]:
    """Ask a child process, so that CUDA is initialised there and not in this process."""
    if torch.version.cuda is None:
        return []  # a CPU-only build of torch cannot use a GPU anyway
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return [GPUInfo(i, n, m, tuple(c)) for i, n, m, c in json.loads(out.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return []


_cached_gpus: list[GPUInfo] | None = None


def _cuda_gpus() -> list[GPUInfo]:
    global _cached_gpus
    if _cached_gpus is None:
        gpus = _gpus_from_nvml()
        _cached_gpus = gpus if gpus is not None else _gpus_from_child_process()
    return _cached_gpus


def _mps_available() -> bool:
    return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())


def _choose_profile(device: str, cpu_count: int) -> tuple[Profile, str]:
    override = os.environ.get("GPUKIT_PROFILE")
    if override:
        if override not in PROFILES:
            raise ValueError(
                f"GPUKIT_PROFILE={override!r} is not a profile; use one of {', '.join(PROFILE_NAMES)} "
                "or unset it to choose automatically."
            )
        return PROFILES[override], "set by GPUKIT_PROFILE"
    if device == "cuda":
        return PROFILES["gpu"], "a CUDA GPU is present"
    if os.environ.get("CI"):
        return PROFILES["tiny"], "CI is set"
    if cpu_count <= 2:
        return PROFILES["tiny"], f"no CUDA GPU and only {cpu_count} CPU cores"
    return PROFILES["cpu"], "no CUDA GPU" + (" (MPS uses laptop sizes)" if device == "mps" else "")


def detect() -> Env:
    """Describe this machine and pick the run profile, without initialising CUDA.

    The profile is `gpu` with a CUDA GPU, `tiny` on CI or a machine with at most 2 cores,
    and `cpu` otherwise; the environment variable GPUKIT_PROFILE overrides the choice.
    """
    gpus = _cuda_gpus()
    cpu_count = os.cpu_count() or 1
    if gpus:
        device = "cuda"
        ampere = all(g.compute_capability is not None and g.compute_capability >= (8, 0) for g in gpus)
        bf16, tf32 = ampere, ampere
    elif _mps_available():
        device, bf16, tf32 = "mps", True, False
    else:
        device, bf16, tf32 = "cpu", True, False  # CPU autocast supports bfloat16
    profile, reason = _choose_profile(device, cpu_count)
    return Env(device, len(gpus), gpus, bf16, tf32, cpu_count, profile, reason)


def resolve_device(device: str | torch.device | None = None) -> torch.device:
    """Turn None (best available), "cuda", "cuda:1", "cpu", … into a checked torch.device."""
    if device is None:
        return torch.device(detect().device)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{device!r} is not a device; use 'cpu', 'cuda', 'cuda:N' or 'mps'.") from error
    if device.type == "cuda":
        count = len(_cuda_gpus())
        if count == 0:
            raise ValueError(f"device='{device}' was asked for but this machine has no CUDA GPU; use device='cpu'.")
        if device.index is not None and device.index >= count:
            raise ValueError(
                f"device='{device}' does not exist: this machine has {count} CUDA GPU(s), cuda:0 to cuda:{count - 1}."
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


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (all devices) so that a run can be repeated."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)  # also seeds every CUDA device, lazily, without initialising CUDA


def as_dict(env: Env) -> dict:
    return asdict(env)
