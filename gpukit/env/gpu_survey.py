"""Which GPUs CUDA will show this process, found without starting CUDA here.

NVML (the driver's management library) lists every GPU; CUDA_VISIBLE_DEVICES chooses and renumbers them as CUDA
would (`_visible_gpus`). Where NVML cannot tell which GPUs CUDA shows (its Python binding is missing, MIG instances,
GPUs of different models), a short-lived child process asks CUDA, which initialises CUDA there and not here. Each
combination of the variables CUDA reads and the torch build is surveyed once per process (`_cuda_survey`).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass, replace

import torch

from .cuda_build import cuda_build_problem


@dataclass
class GPUInfo:
    index: int  # CUDA's number for it in this process (after CUDA_VISIBLE_DEVICES): torch.device("cuda", index)
    name: str
    memory_bytes: int  # 0 where NVML could not say
    compute_capability: tuple[int, int] | None
    uuid: str | None = None  # "GPU-…" as `nvidia-smi -L` prints it; None where unknown (child-process probe)


def ask_nvml(pynvml, name: str, *args):
    """Call the NVML query `name`; None where this binding, driver or GPU does not have it. Text as str."""
    function = getattr(pynvml, name, None)
    if function is None:
        return None
    try:
        value = function(*args)
    except pynvml.NVMLError:  # NotSupported, NoPermission, FunctionNotFound (older driver), GpuIsLost, …
        return None
    return value.decode() if isinstance(value, bytes) else value  # bytes in older bindings


def nvml_cuda_version(pynvml) -> tuple[int, int] | None:
    """The newest CUDA the driver supports, e.g. 12040 → (12, 4); None where NVML cannot say."""
    # _v2 asks the CUDA driver library itself (cuDriverGetVersion), so it also sees a forward-compatibility
    # libcuda; the first version answers a "known supported" number when it finds no libcuda.
    version = ask_nvml(pynvml, "nvmlSystemGetCudaDriverVersion_v2")
    if version is None:
        version = ask_nvml(pynvml, "nvmlSystemGetCudaDriverVersion")
    return None if version is None else (version // 1000, version % 1000 // 10)


@dataclass
class _NVMLView:
    gpus: list[GPUInfo]  # every GPU, numbered as NVML and nvidia-smi number them (by PCI bus)
    driver_cuda: tuple[int, int] | None  # newest CUDA the driver supports
    mig: bool  # a GPU is split into MIG instances, which CUDA shows instead of the whole GPU


def _read_nvml() -> _NVMLView | None:
    """Every GPU and the driver's CUDA version as NVML sees them; None if NVML's binding is not installed."""
    try:
        import pynvml  # provided by the nvidia-ml-py package (extra "gpu")
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return _NVMLView([], None, False)  # binding present, no driver: no NVIDIA GPU
    try:
        gpus, mig = [], False
        for index in range(ask_nvml(pynvml, "nvmlDeviceGetCount") or 0):
            handle = ask_nvml(pynvml, "nvmlDeviceGetHandleByIndex", index)
            if handle is None:  # e.g. a GPU the driver lost ("fallen off the bus"): CUDA cannot use it either
                continue
            memory = ask_nvml(pynvml, "nvmlDeviceGetMemoryInfo", handle)
            capability = ask_nvml(pynvml, "nvmlDeviceGetCudaComputeCapability", handle)
            name = ask_nvml(pynvml, "nvmlDeviceGetName", handle) or f"GPU {index}"
            uuid = ask_nvml(pynvml, "nvmlDeviceGetUUID", handle)
            capability = tuple(capability) if capability else None
            gpus.append(GPUInfo(index, name, int(memory.total) if memory else 0, capability, uuid))
            mig = mig or (ask_nvml(pynvml, "nvmlDeviceGetMigMode", handle) or [0])[0] == 1  # [current, pending]
        return _NVMLView(gpus, nvml_cuda_version(pynvml), mig)
    finally:
        ask_nvml(pynvml, "nvmlShutdown")


def _gpu_by_index(gpus: list[GPUInfo], entry: str) -> GPUInfo | None:
    digits = re.match(r"[+-]?\d+", entry)  # CUDA reads an index as strtoul does: "1abc" is 1
    number = int(digits.group()) if digits else -1
    return next((gpu for gpu in gpus if gpu.index == number), None)


def _gpu_by_uuid(gpus: list[GPUInfo], entry: str) -> GPUInfo | None:
    if not entry.startswith("GPU-"):
        return None
    found = [gpu for gpu in gpus if gpu.uuid and gpu.uuid.startswith(entry)]
    return found[0] if len(found) == 1 else None  # a prefix that two GPUs share names neither


def _visible_gpus(gpus: list[GPUInfo], visible_devices: str | None) -> list[GPUInfo] | None:
    """The GPUs CUDA shows a process with this CUDA_VISIBLE_DEVICES, renumbered from 0 in its order.

    The rules of the CUDA Programming Guide (appendix "CUDA Environment Variables"), with the details that
    torch.cuda._parse_visible_devices follows too: the entries are all indices or all UUIDs ("GPU-…", or
    any prefix that names one GPU), whichever the first entry is; the first entry that names no GPU ends
    the list ("0,2,-1,1" shows 0 and 2; "", "-1" and "NoDevFiles" show none); a GPU named twice makes CUDA
    show none. None: the entries name MIG instances, which only CUDA itself resolves.
    """
    if visible_devices is None:
        return [replace(gpu, index=number) for number, gpu in enumerate(gpus)]
    entries = [entry.strip() for entry in visible_devices.split(",")]
    if entries[0].startswith("MIG-"):
        return None
    find = _gpu_by_uuid if entries[0].startswith("GPU-") else _gpu_by_index
    chosen: list[GPUInfo] = []
    for entry in entries:
        gpu = find(gpus, entry)
        if gpu is None:
            break
        if any(gpu.index == other.index for other in chosen):
            return []
        chosen.append(gpu)
    return [replace(gpu, index=number) for number, gpu in enumerate(chosen)]


def _nvml_numbers_as_cuda(view: _NVMLView) -> bool:
    # NVML numbers GPUs by PCI bus. CUDA does so too with CUDA_DEVICE_ORDER=PCI_BUS_ID, but by default it puts
    # the fastest first (ties by PCI bus): the same order only when all GPUs are alike. MIG instances replace
    # their GPU in CUDA's list.
    alike = len({(gpu.name, gpu.compute_capability) for gpu in view.gpus}) <= 1
    return not view.mig and (alike or os.environ.get("CUDA_DEVICE_ORDER") == "PCI_BUS_ID")


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
    """Ask CUDA in a child process (which inherits CUDA_VISIBLE_DEVICES), so that it starts there, not here."""
    if torch.version.cuda is None:
        return []  # a CPU-only build of torch cannot use a GPU anyway
    try:
        out = subprocess.run(
            [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=120, check=True
        ).stdout
        return [GPUInfo(i, n, m, tuple(c)) for i, n, m, c in json.loads(out.strip().splitlines()[-1])]
    except (subprocess.SubprocessError, ValueError, IndexError, OSError):
        return []


@dataclass
class _Survey:
    gpus: list[GPUInfo]  # the GPUs CUDA shows this process, numbered as CUDA numbers them
    problem: str  # why this torch cannot use them (cuda_build_problem); "" when it can or there are none


def _no_nvidia_driver() -> bool:
    """True where no NVIDIA driver is loaded, so that no GPU can exist: Linux without the driver's device files
    (/dev/nvidiactl, /dev/nvidia0, …), its /proc entry, or WSL's GPU device /dev/dxg. Elsewhere False (unknown)."""
    if not sys.platform.startswith("linux"):
        return False
    if os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/dxg"):
        return False
    try:
        return not any(name.startswith("nvidia") for name in os.listdir("/dev"))
    except OSError:
        return False


def _survey() -> _Survey:
    """Ask NVML; where it cannot tell what CUDA will show (no binding, MIG, unlike GPUs), ask a child process.

    Without NVML's binding on a machine with no NVIDIA driver the answer is known without asking: no GPU. A child
    process imports torch to ask CUDA, which took 3-9 s on a loaded 2-core machine."""
    view = _read_nvml()
    if view is None and _no_nvidia_driver():
        return _Survey([], "")
    if view is None:  # the child reports only GPUs that torch can use, so no problem is left to explain
        return _Survey(_gpus_from_child_process(), "")
    gpus = _visible_gpus(view.gpus, os.environ.get("CUDA_VISIBLE_DEVICES"))
    problem = cuda_build_problem(torch.__version__, torch.version.cuda, view.driver_cuda)
    if not problem and (gpus is None or not _nvml_numbers_as_cuda(view)):
        gpus = _gpus_from_child_process()
    gpus = gpus or []  # with a problem, NVML's numbering is the best guess there is; MIG entries: none
    return _Survey(gpus, problem if gpus else "")


# What CUDA shows depends on these variables (read when CUDA starts) and on the torch build: each
# combination is surveyed once per process.
_surveys: dict[tuple[str | None, ...], _Survey] = {}


def _cuda_survey() -> _Survey:
    key = (os.environ.get("CUDA_VISIBLE_DEVICES"), os.environ.get("CUDA_DEVICE_ORDER"), torch.version.cuda)
    if key not in _surveys:
        _surveys[key] = _survey()
    return _surveys[key]
