"""Device detection, seeding and run profiles.

Detection never initialises CUDA in the calling process: it asks NVML (the driver's
management library) instead of the CUDA runtime, so a notebook can still fork worker
processes that use the GPU afterwards. NVML knows neither CUDA_VISIBLE_DEVICES nor what
torch was built for, so detection applies both itself: the GPUs CUDA would show, and whether
this torch's CUDA version can run on the driver. Where NVML cannot tell which GPUs CUDA shows
(its Python binding is missing, MIG instances, GPUs of different models), a short-lived child
process asks CUDA, which initialises CUDA there and not here.
"""

from __future__ import annotations

import json
import math
import os
import random
import re
import subprocess
import sys
from dataclasses import asdict, dataclass, field, replace

import numpy as np
import torch

from .validation import check_seed

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


@dataclass
class GPUInfo:
    index: int  # CUDA's number for it in this process (after CUDA_VISIBLE_DEVICES): torch.device("cuda", index)
    name: str
    memory_bytes: int  # 0 where NVML could not say
    compute_capability: tuple[int, int] | None
    uuid: str | None = None  # "GPU-…" as `nvidia-smi -L` prints it; None where unknown (child-process probe)


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


# ---------------------------------------------------------------------------------------------
# Can this torch run on this driver?

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


# ---------------------------------------------------------------------------------------------
# Which GPUs CUDA will show this process, found without starting CUDA here


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


_explained: set[str] = set()  # problems detect() has printed once in this process


def _explain_once(gpus: list[GPUInfo], problem: str) -> None:
    if problem and problem not in _explained:
        _explained.add(problem)
        names = ", ".join(gpu.name for gpu in gpus)
        print(f"gpukit.detect(): using the CPU, not the GPU(s) here ({names}), because {problem}.", file=sys.stderr)


# ---------------------------------------------------------------------------------------------
# How many CPU threads to compute and time with


def usable_cpus() -> int:
    """CPUs this process may run on: its CPU affinity, capped by a container's CPU quota (cgroup v2)."""
    count = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        with open("/sys/fs/cgroup/cpu.max") as file:
            quota, period = file.read().split()[:2]  # "max 100000" (no limit) or "200000 100000" (2 CPUs)
        if quota != "max":
            count = min(count, max(1, -(-int(quota) // int(period))))  # round up: 1.5 CPUs → 2 threads
    except (OSError, ValueError):
        pass  # not Linux, no cgroup v2, or no quota
    return count


def cpu_load() -> float | None:
    """The 1-minute load average (runnable processes, ours included), or None where the OS has none (Windows)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def cpu_threads(usable: int, load: float | None, default: int) -> tuple[int, str]:
    """The intra-op threads to run and time CPU work with, from `usable` CPUs, the `load` average and torch's
    `default` thread count; with the reason, in words a learner can act on.

    torch's CPU kernels run on OpenMP threads that spin while they wait for each other. When any one of them loses
    its core to another program, the others spin until it comes back, so a step can take many times longer: a small
    GPT's training step took 63 ms on 1 thread and 1,204 ms on 2 (medians of 8, interleaved) on a 2-core machine at
    load 3. One thread per core that nobody else uses is the safe choice: on at most 2 CPUs that is 1 (a notebook's
    own server, a browser or a shared job takes the other), and on a loaded machine every core the load occupies is
    left free. An idle machine with more cores keeps torch's default.
    """
    if usable <= 2:
        return 1, (
            f"{usable} usable CPU(s): more than one thread spins whenever another program takes a core (a small "
            "GPT's step took 19-32x as long on 2 threads as on 1 on busy 2-core machines)"
        )
    busy = 0 if load is None else math.ceil(load - 0.5)  # cores other programs keep busy (the load rounded)
    if busy >= 1:
        threads = max(1, min(default, usable - busy))
        if threads < default:
            return threads, (
                f"load {load:.1f} on {usable} usable CPUs: other programs keep about {busy} core(s) busy, and "
                "threads that lose their core make the others spin"
            )
    return min(default, usable), f"{usable} usable CPUs, load {'unknown' if load is None else f'{load:.1f}'}"


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
    return _automatic_profile(device, cpu_count)


def _automatic_profile(device: str, cpu_count: int) -> tuple[Profile, str]:
    if device == "cuda":
        return PROFILES["gpu"], "a CUDA GPU is present"
    if os.environ.get("CI"):
        return PROFILES["tiny"], "CI is set"
    if cpu_count <= 2:
        return PROFILES["tiny"], f"no usable CUDA GPU and only {cpu_count} CPU cores"
    return PROFILES["cpu"], "no usable CUDA GPU" + (" (MPS uses laptop sizes)" if device == "mps" else "")


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
