"""Can this torch run on this driver? A torch built for CUDA M.y runs on any driver of CUDA M.0 or newer; where it
cannot, `cuda_build_problem` says why and which torch to install."""

from __future__ import annotations

# Oldest NVIDIA driver of each CUDA major version (CUDA Compatibility guide, "Minor Version Compatibility",
# table 1: https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html).
_MIN_DRIVER = {11: "450.80.02", 12: "525", 13: "580"}
# PyTorch wheel indexes for a driver of each CUDA major: the oldest minor published, which runs on every
# driver of that major (see below). https://pytorch.org/get-started/locally/ lists the current builds.
_TORCH_INDEX = {12: "cu126", 13: "cu130"}


def _major_minor(version: str) -> tuple[int, int] | None:
    """'13.0' → (13, 0); text that is not a dotted version → None."""
    try:
        major, minor = version.split(".")[:2]
        return int(major), int(minor)
    except ValueError:
        return None


def _install_hint(driver_cuda: tuple[int, int] | None) -> str:
    """The command that installs a torch for this driver (a newer driver runs older CUDA builds too)."""
    majors = [major for major in _TORCH_INDEX if driver_cuda is not None and major <= driver_cuda[0]]
    if not majors:
        return "https://pytorch.org/get-started/locally/ lists the builds"
    url = f"https://download.pytorch.org/whl/{_TORCH_INDEX[max(majors)]}"
    return f"pip install --force-reinstall torch torchvision --index-url {url}"


def cuda_build_problem(torch_version: str, built_for: str | None, driver_cuda: tuple[int, int] | None) -> str:
    """Why torch `torch_version`, built for CUDA `built_for` ("13.0"; None: a CPU-only build), cannot run on
    a driver that supports CUDA up to `driver_cuda` (e.g. (12, 4)), and what to install; "" when it can
    or when the driver's version is unknown."""
    if built_for is None:
        return f"torch {torch_version} is a CPU-only build: install a CUDA build ({_install_hint(driver_cuda)})"
    needed = _major_minor(built_for)
    # CUDA minor-version compatibility (CUDA 11 onwards): a program built with CUDA M.y runs, with a limited
    # feature set, on any driver that supports CUDA M.0 or newer; a driver of an older major cannot run it.
    # https://docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html
    if needed is None or driver_cuda is None or driver_cuda >= (needed[0], 0):
        return ""
    minimum = _MIN_DRIVER.get(needed[0])
    update = f">= {minimum}" if minimum else f"one for CUDA {needed[0]}"
    return (
        f"the NVIDIA driver supports CUDA {'.'.join(map(str, driver_cuda))} but torch {torch_version} was built "
        f"for CUDA {built_for}: install a torch built for CUDA {driver_cuda[0]} ({_install_hint(driver_cuda)}) "
        f"or update the NVIDIA driver to {update}"
    )
