"""Environment report: versions, CPU threads, the chosen device, and GPU health as NVML sees it.

`collect()` gathers facts into a plain `Report`; `warnings(report)` derives what looks wrong
from those facts alone, so every rule can be tested on a CPU with a fabricated report.

Nothing here initialises CUDA in this process, so a notebook can still fork GPU workers after
calling `doctor()`: GPU facts come from NVML (the driver's management library), versions from
what torch was built with, and the device from `gpukit.detect()`.

What the lessons import is imported in a fresh Python, as a lesson's kernel would (`import_check`): gpukit's own
dependencies, torchvision's compiled operators and image codecs run on a tiny tensor, and the `lessons` extra. A
torch/torchvision pair that does not belong together (a CPU torch beside a CUDA torchvision: "operator
torchvision::nms does not exist") fails there, and the report says which torchvision to install. A crash of that
Python (a compiled library of the wrong build) is reported, not suffered.

`gk.doctor()` is this package's `doctor` (the package is named for what it does, a checkup, so that
`gpukit.doctor` is one thing: the function).

report.py      `Report` (the facts, as tables) and `warnings(report)`: what looks wrong, each with what to do
nvml.py        each GPU's state from NVML (`GPUStatus`), and what looks wrong with one GPU
imports.py     `import_check()`: what the lessons import, in a fresh Python; the torchvision for this torch
__init__.py    `collect()` gathers the facts; `doctor()` is `collect()` shown
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import shutil
import sys

import torch

from ..deprecation import renamed
from ..env import cpu_load, detect, usable_cpus
from .imports import (
    IMPORT_CHECKS,
    IMPORT_SECONDS,
    LESSONS_EXTRA,
    import_check,
    torch_for,
    torchvision_for,
    torchvision_install_command,
)
from .nvml import NVIDIA_DRIVER_PATHS, GPUProcess, GPUStatus, _nvml_facts, nvidia_gpu_may_be_present
from .report import Report, warnings

__all__ = [
    "IMPORT_CHECKS",
    "IMPORT_SECONDS",
    "LESSONS_EXTRA",
    "NVIDIA_DRIVER_PATHS",
    "GPUProcess",
    "GPUStatus",
    "Report",
    "collect",
    "doctor",
    "import_check",
    "nvidia_gpu_may_be_present",
    "torch_for",
    "torchvision_for",
    "torchvision_install_command",
    "warnings",
]

# ---------------------------------------------------------------------------------------------
# Collecting facts


def _cudnn_version() -> str | None:
    # torch.backends.cudnn.version() also checks the devices' compute capability, which
    # initialises CUDA; the number it returns is the one read here without that check.
    if not torch.backends.cudnn.is_available():
        return None
    try:
        from torch._C import _cudnn

        number = _cudnn.getVersionInt()
    except (ImportError, AttributeError, RuntimeError):
        return None
    # cuDNN 9 encodes major*10000 + minor*100 + patch; cuDNN 8 and older major*1000 + minor*100 + patch.
    major, rest = (number // 10000, number % 10000) if number >= 90000 else (number // 1000, number % 1000)
    return f"{major}.{rest // 100}.{rest % 100}"


def _nccl_version() -> str | None:
    # Asks the NCCL library for its version number; this needs no GPU and does not initialise CUDA.
    try:
        import torch.cuda.nccl

        return ".".join(str(part) for part in torch.cuda.nccl.version())
    except (ImportError, AttributeError, RuntimeError):
        return None  # torch built without NCCL (CPU-only, macOS, Windows)


def collect(check_imports: bool = True) -> Report:
    """Gather the facts of this environment, without initialising CUDA in this process.

    check_imports: import what the lessons import in a fresh Python (8-15 s, import_check); False skips it."""
    try:
        # From the installed package's metadata: importing torchvision takes seconds.
        torchvision_version = importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:
        torchvision_version = None
    try:
        env = detect()
        device, profile, profile_reason, detect_error = env.device, env.profile.name, env.profile_reason, None
        visible_gpus = [gpu.name for gpu in env.gpus]
    except ValueError as error:  # a bad GPUKIT_PROFILE: report it rather than fail the doctor
        device, profile, profile_reason, detect_error = None, None, "", str(error)
        visible_gpus = []
    imports, import_state = import_check() if check_imports else ({}, "not run")
    return Report(
        python_version=sys.version.split()[0],
        platform=platform.platform(),
        torch_version=torch.__version__,
        torchvision_version=torchvision_version,
        cuda_runtime=torch.version.cuda,
        cudnn_version=_cudnn_version(),
        nccl_version=_nccl_version(),
        cpu_count=os.cpu_count() or 1,
        usable_cpus=usable_cpus(),
        torch_threads=torch.get_num_threads(),
        load=cpu_load(),
        device=device,
        profile=profile,
        profile_reason=profile_reason,
        detect_error=detect_error,
        cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES"),
        visible_gpus=visible_gpus,
        nvidia_smi=shutil.which("nvidia-smi") is not None,
        imports=imports,
        import_check=import_state,
        **_nvml_facts(),
    )


def doctor(check_imports: bool = True) -> Report:
    """Report this environment and what looks wrong in it; shows as a table in Jupyter and in print().

    Safe before forking GPU workers: it never initialises CUDA in this process. check_imports: try what the lessons
    import in a fresh Python (8-15 s); `report.broken` lists what fails.
    """
    return collect(check_imports)


__getattr__ = renamed(__name__, {"decode_clock_reasons": "gpukit.hardware.clocks:clock_reasons"})
