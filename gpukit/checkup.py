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

`gk.doctor()` is this module's `doctor` (the module is named for what it does, a checkup, so that
`gpukit.doctor` is one thing: the function).
"""

from __future__ import annotations

import html
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

import torch

from .deprecation import renamed
from .env import ask_nvml, cpu_load, cpu_threads, cuda_build_problem, detect, nvml_cuda_version, usable_cpus
from .hardware.clocks import BENIGN_CLOCK_REASONS, clock_reasons
from .hardware.gpus import find_gpu
from .report import Table, format_bytes

# What to do about each reason that lowers clocks under load: one sentence each.
_CLOCK_ADVICE = {
    "software power cap": "It is at its power limit: normal under full load, but check the limit with "
    "`nvidia-smi -q -d POWER`.",
    "hardware slowdown": "The hardware slowed it (overheating or the power supply): ask the machine's admin to "
    "check cooling and power.",
    "sync boost": "It is held to the clocks of a sync-boost group: ask the admin whether the group is needed.",
    "software thermal slowdown": "It is too hot: improve cooling or airflow, and let it cool down.",
    "hardware thermal slowdown": "It is too hot: improve cooling or airflow, and let it cool down.",
    "hardware power brake slowdown": "The power supply asked it to slow down: ask the admin to check the power supply.",
}
_DEFAULT_CLOCK_ADVICE = "See why with `nvidia-smi -q -d PERFORMANCE`."


@dataclass
class GPUProcess:
    """A process holding memory on a GPU (from NVML's list of compute processes)."""

    pid: int  # as the driver sees it: inside a container this can be the host's PID
    used_memory: int | None = None  # bytes; None where the driver does not say (e.g. Windows WDDM)
    name: str | None = None


@dataclass
class GPUStatus:
    """One GPU's state at the moment of the report. None: NVML could not tell."""

    index: int
    name: str
    memory_total: int | None = None  # bytes
    memory_used: int | None = None  # bytes, by all processes
    utilization: int | None = None  # % of the last sample period in which a kernel ran
    temperature: int | None = None  # °C
    power_draw: float | None = None  # W
    power_limit: float | None = None  # W, the enforced limit
    power_limit_default: float | None = None  # W, the limit the board ships with
    persistence_mode: bool | None = None  # driver kept loaded between jobs (Linux); off adds start-up latency
    ecc_errors: int | None = None  # uncorrected ECC memory errors since the driver loaded; None: no ECC
    sm_clock: int | None = None  # MHz
    memory_clock: int | None = None  # MHz
    clock_reasons: list[str] = field(default_factory=list)  # why clocks are below maximum, decoded
    processes: list[GPUProcess] = field(default_factory=list)


@dataclass(repr=False)
class Report:
    """Facts about this environment. Every field has a default so tests can fabricate one."""

    python_version: str = ""
    platform: str = ""
    torch_version: str = ""
    torchvision_version: str | None = None  # None: not installed
    cuda_runtime: str | None = None  # torch.version.cuda, e.g. "12.8"; None for a CPU-only build
    cudnn_version: str | None = None
    nccl_version: str | None = None
    cpu_count: int = 1  # logical CPUs of the machine
    usable_cpus: int = 1  # CPUs this process may use (affinity and container CPU quota)
    torch_threads: int = 1  # torch intra-op threads
    load: float | None = None  # the 1-minute load average; None where the OS has none
    device: str | None = None  # what gpukit.detect() chose: "cuda", "mps" or "cpu"
    profile: str | None = None
    profile_reason: str = ""
    detect_error: str | None = None  # gpukit.detect() raised this (e.g. a bad GPUKIT_PROFILE)
    cuda_visible_devices: str | None = None  # the environment variable; None: not set (CUDA shows every GPU)
    visible_gpus: list[str] = field(default_factory=list)  # names of the GPUs CUDA shows (gpukit.detect), in order
    nvml: str = "not installed"  # "ok", or why NVML gave no GPU facts
    driver_version: str | None = None
    driver_cuda_version: str | None = None  # newest CUDA the driver supports, e.g. "12.4"
    gpus: list[GPUStatus] = field(default_factory=list)
    nvidia_smi: bool = False  # nvidia-smi is on PATH: a hint of NVIDIA GPUs even without NVML
    pid: int = field(default_factory=os.getpid)  # the process that collected the report
    # What the lessons import, tried in a fresh Python (import_check): label → "ok", "not installed (NAME)" or the
    # error ("RuntimeError: operator torchvision::nms does not exist"). Empty: not checked.
    imports: dict[str, str] = field(default_factory=dict)
    import_check: str = "not run"  # "ok", or why the check gave no answer ("did not finish in 300 s")

    @property
    def broken(self) -> list[str]:
        """What the lessons import that fails here: labels of IMPORT_CHECKS. Not empty: the lessons cannot run."""
        return [
            label
            for label, outcome in self.imports.items()
            if outcome != "ok" and not (label in LESSONS_EXTRA and outcome.startswith("not installed"))
        ]

    @property
    def safe_threads(self) -> tuple[int, str]:
        """The threads CPU work should run and be timed with here, and why (gpukit.env.cpu_threads)."""
        return cpu_threads(self.usable_cpus, self.load, self.torch_threads)

    def facts_table(self) -> Table:
        cpus = f"{self.usable_cpus} usable of {self.cpu_count}"
        if self.profile is None:
            profile = "n/a (gpukit.detect() failed)" if self.detect_error else None
        else:
            profile = f"{self.profile} ({self.profile_reason})" if self.profile_reason else self.profile
        rows = [
            ("Python", self.python_version),
            ("platform", self.platform),
            ("torch", self.torch_version),
            ("torchvision", self.torchvision_version or "not installed"),
            ("what the lessons import", self._imports_fact()),
            ("CUDA runtime (torch built for)", self.cuda_runtime or "none (CPU-only build)"),
            ("cuDNN", self.cudnn_version),
            ("NCCL", self.nccl_version),
            ("CPUs", cpus),
            ("load average (1 min)", "unknown" if self.load is None else f"{self.load:.1f}"),
            ("torch intra-op threads", self.torch_threads),
            ("threads to time CPU work with", "{} ({})".format(*self.safe_threads)),
            ("device (gpukit.detect)", self.device),
            (
                "CUDA_VISIBLE_DEVICES",
                "not set" if self.cuda_visible_devices is None else repr(self.cuda_visible_devices),
            ),
            ("GPUs CUDA shows (gpukit.detect)", ", ".join(self.visible_gpus) or "none"),
            ("profile", profile),
            ("NVML", self.nvml),
            ("NVIDIA driver", self.driver_version),
            ("driver supports CUDA up to", self.driver_cuda_version),
        ]
        return Table([{"item": item, "value": value} for item, value in rows], title="gpukit doctor")

    def _imports_fact(self) -> str:
        if not self.imports:
            return f"not checked ({self.import_check})" if self.import_check != "not run" else "not checked"
        if self.broken:
            return "FAILS: " + ", ".join(self.broken) + " (see the warnings)"
        missing = [label for label, outcome in self.imports.items() if outcome != "ok"]
        if missing:
            return f"imports; not installed: {', '.join(missing)} (pip install 'gpukit[lessons]')"
        return "all of it imports, torchvision's operators run"

    def gpu_table(self) -> Table:
        rows = [
            {
                "gpu": gpu.index,
                "name": gpu.name,
                "memory used / total": f"{format_bytes(gpu.memory_used)} / {format_bytes(gpu.memory_total)}",
                "util %": gpu.utilization,
                "temp °C": gpu.temperature,
                "power W": f"{_number(gpu.power_draw)} / {_number(gpu.power_limit)}",
                "limit / default W": f"{_number(gpu.power_limit)} / {_number(gpu.power_limit_default)}",
                "persistence": gpu.persistence_mode,
                "ECC errors": gpu.ecc_errors,
                "datasheet": _datasheet(gpu.name),
                "SM MHz": gpu.sm_clock,
                "memory MHz": gpu.memory_clock,
                "clocks limited by": ", ".join(gpu.clock_reasons) or "nothing",
            }
            for gpu in self.gpus
        ]
        return Table(rows, title="GPUs (from NVML)")

    def process_table(self) -> Table:
        rows = [
            {
                "gpu": gpu.index,
                "pid": process.pid,
                "name": process.name,
                "memory": format_bytes(process.used_memory),
                "who": "this process" if process.pid == self.pid else "another process",
            }
            for gpu in self.gpus
            for process in gpu.processes
        ]
        return Table(rows, columns=["gpu", "pid", "name", "memory", "who"], title="Processes holding GPU memory")

    def _tables(self) -> list[Table]:
        tables = [self.facts_table()]
        if self.gpus:
            tables.append(self.gpu_table())
            if any(gpu.processes for gpu in self.gpus):
                tables.append(self.process_table())
        return tables

    @property
    def verdict(self) -> str:
        """One line: whether the lessons can run here (`gpukit doctor` exits 1 when they cannot)."""
        if self.broken:
            return f"verdict: BROKEN: {', '.join(self.broken)} fails to import or run; the lessons cannot run here"
        count = len(warnings(self))
        return f"verdict: ready, with {count} warning(s) above" if count else "verdict: ready"

    def __str__(self) -> str:
        found = warnings(self)
        listed = "\n".join(["Warnings:", *(f"- {warning}" for warning in found)]) if found else "no problems found"
        return "\n\n".join([str(table) for table in self._tables()] + [listed, self.verdict])

    __repr__ = __str__

    def _repr_html_(self) -> str:
        found = warnings(self)
        if found:
            items = "".join(f"<li>{html.escape(warning)}</li>" for warning in found)
            verdict = f"<p><b>Warnings</b></p><ul>{items}</ul>"
        else:
            verdict = "<p><b>no problems found</b></p>"
        verdict += f"<p><b>{html.escape(self.verdict)}</b></p>"
        return "<div>" + "".join(table._repr_html_() for table in self._tables()) + verdict + "</div>"


def _number(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.0f}"


def _datasheet(device_name: str) -> str:
    """The GPU table's row for this GPU, in a few words (gk.hardware.GPUS)."""
    gpu = find_gpu(device_name)
    if gpu is None:
        return "not in gk.hardware.GPUS"
    bf16 = f"{gpu.bf16:g} bf16 TFLOP/s" if gpu.bf16 is not None else "no bf16"
    return f"{gpu.name}: cc {gpu.compute_capability[0]}.{gpu.compute_capability[1]}, {bf16}, TDP {gpu.tdp_w:g} W"


# ---------------------------------------------------------------------------------------------
# Warnings: pure functions of a Report


def _version_tuple(version: str | None) -> tuple[int, ...] | None:
    """'12.4' → (12, 4); None or text that is not a dotted version → None."""
    if not version:
        return None
    try:
        return tuple(int(part) for part in version.split(".")[:2])
    except ValueError:
        return None


def _driver_warning(report: Report) -> str | None:
    runtime, driver = _version_tuple(report.cuda_runtime), _version_tuple(report.driver_cuda_version)
    if runtime is None or driver is None or driver >= runtime:
        return None
    version = f" {report.driver_version}" if report.driver_version else ""
    problem = cuda_build_problem(report.torch_version, report.cuda_runtime, driver)
    if problem:  # a driver of an older CUDA major version: gpukit.detect() falls back to the CPU
        return f"CUDA will fail to start with the NVIDIA driver{version}, so gpukit uses the CPU: {problem}."
    return (
        f"The NVIDIA driver{version} supports CUDA up to {report.driver_cuda_version}, but torch "
        f"{report.torch_version} was built for CUDA {report.cuda_runtime}: it runs through CUDA minor-version "
        "compatibility, but features newer than the driver (some compiled kernels) may fail. Update the NVIDIA "
        f"driver to one for CUDA {report.cuda_runtime} or newer, or install a torch build for CUDA "
        f"{report.driver_cuda_version} or older (https://pytorch.org/get-started/locally/)."
    )


def _clock_warning(gpu: GPUStatus) -> str | None:
    limiting = [reason for reason in gpu.clock_reasons if reason not in BENIGN_CLOCK_REASONS]
    if not limiting:
        return None
    # One piece of advice per distinct cause, in the order the reasons were reported.
    advice = " ".join(dict.fromkeys(_CLOCK_ADVICE.get(reason, _DEFAULT_CLOCK_ADVICE) for reason in limiting))
    return (
        f"GPU {gpu.index} ({gpu.name}) runs below full clocks because of {', '.join(limiting)}, so timings "
        f"taken now understate it. {advice} Then measure again."
    )


def _process_warning(gpu: GPUStatus, own_pid: int) -> str | None:
    others = [process for process in gpu.processes if process.pid != own_pid]
    if not others:
        return None
    listed = ", ".join(
        f"PID {process.pid}" + (f" {process.name}" if process.name else "") + f" ({format_bytes(process.used_memory)})"
        for process in others
    )
    return (
        f"GPU {gpu.index} ({gpu.name}) has memory held by {len(others)} other process(es): {listed}. They compete "
        "for memory and compute, so measurements will be noisy and large batches may not fit; stop them if they "
        "are yours (a forgotten notebook kernel?) or pick a free GPU with CUDA_VISIBLE_DEVICES."
    )


def _power_limit_warning(gpu: GPUStatus) -> str | None:
    if gpu.power_limit is None or gpu.power_limit_default is None or gpu.power_limit >= gpu.power_limit_default - 1:
        return None
    return (
        f"GPU {gpu.index} ({gpu.name}) has a power limit of {gpu.power_limit:.0f} W, below its default "
        f"{gpu.power_limit_default:.0f} W, so under load it runs at lower clocks than its datasheet figures. If that "
        "is not intended, ask the machine's admin (`nvidia-smi -q -d POWER` shows both)."
    )


def _ecc_warning(gpu: GPUStatus) -> str | None:
    if not gpu.ecc_errors:
        return None
    return (
        f"GPU {gpu.index} ({gpu.name}) reports {gpu.ecc_errors} uncorrected ECC memory error(s) since the driver "
        "loaded: results computed on it may be wrong. Ask the machine's admin to check it (`nvidia-smi -q -d ECC`)."
    )


def _cpu_only_build_warning(report: Report) -> str | None:
    if report.cuda_runtime is not None or not (report.gpus or report.nvidia_smi):
        return None
    seen = f"NVML sees {', '.join(gpu.name for gpu in report.gpus)}" if report.gpus else "nvidia-smi is on PATH"
    problem = cuda_build_problem(report.torch_version, None, _version_tuple(report.driver_cuda_version))
    return f"This machine has NVIDIA GPUs ({seen}) but everything runs on the CPU: {problem}."


def _visible_devices_warning(report: Report) -> str | None:
    """CUDA_VISIBLE_DEVICES hides GPUs that NVML sees: all of them, or those after an entry that names none."""
    value = report.cuda_visible_devices
    usable = not cuda_build_problem(
        report.torch_version, report.cuda_runtime, _version_tuple(report.driver_cuda_version)
    )
    if value is None or not report.gpus or report.device is None or not usable:
        return None
    entries = [entry for entry in value.split(",") if entry.strip()]
    shown = len(report.visible_gpus)
    if shown == 0:
        what = (
            f"hides all {len(report.gpus)} NVIDIA GPU(s) from CUDA (an empty list, a first entry that names no GPU "
            "here, or a GPU named twice shows none), so gpukit uses the CPU"
        )
    elif shown < len(entries):
        what = (
            f"lists {len(entries)} entries but CUDA shows only {shown} GPU(s): CUDA stops at the first entry "
            "that names no GPU here"
        )
    else:
        return None
    return (
        f"CUDA_VISIBLE_DEVICES={value!r} {what}. Unset it to use every GPU, or list the GPUs you want by index or "
        "UUID as `nvidia-smi -L` prints them."
    )


def _threads_warning(report: Report) -> str | None:
    threads, reason = report.safe_threads
    if report.torch_threads <= threads:
        return None
    return (
        f"torch uses {report.torch_threads} intra-op threads where {threads} is safe here ({reason}): CPU steps "
        f"will take longer and swing from one run to the next. Call torch.set_num_threads({threads}) (the lessons "
        f"do, from gk.detect().threads) or set OMP_NUM_THREADS={threads} before starting Python."
    )


def _load_warning(report: Report) -> str | None:
    if report.load is None or report.load <= report.usable_cpus:
        return None
    return (
        f"the CPU is oversubscribed: load {report.load:.1f} on {report.usable_cpus} usable CPUs, so other programs "
        "share the cores and every CPU timing here varies with them. Compare ratios measured side by side in one "
        "cell (as the lessons do), or stop the other jobs before timing."
    )


def torchvision_for(torch_version: str) -> str | None:
    """The torchvision release made for a torch 2.x release: 0.(x + 15). "2.14.1+cpu" → "0.29"; None for others."""
    found = re.match(r"2\.(\d+)", torch_version)
    return f"0.{int(found[1]) + 15}" if found else None


def torch_for(torchvision_version: str) -> str | None:
    """The torch release a torchvision 0.y (y >= 15) release was made for: 2.(y - 15). "0.28.0+cu130" → "2.13"."""
    found = re.match(r"0\.(\d+)", torchvision_version)
    return f"2.{int(found[1]) - 15}" if found and int(found[1]) >= 15 else None


def _build(version: str) -> str | None:
    """The build a PyTorch wheel's local version names: "2.14.1+cpu" → "cpu", "0.29.1+cu130" → "cu130"."""
    return version.partition("+")[2] or None


def torchvision_install_command(torch_version: str) -> str:
    """The pip command that installs the torchvision made for this torch (same release and build), torch untouched."""
    release, build = torchvision_for(torch_version), _build(torch_version)
    # PyTorch's own index serves each build under its name (whl/cpu, whl/cu130); PyPI's wheels carry no build name.
    index = f" --index-url https://download.pytorch.org/whl/{build}" if build else ""
    return f'pip install --force-reinstall --no-deps "torchvision=={release}.*"{index}'


def _pair_warning(report: Report) -> str | None:
    """torch and torchvision that do not belong together: torchvision fails here, was made for another torch release,
    or is another build (cpu, cu130); with the command that installs the torchvision made for this torch."""
    vision, wanted = report.torchvision_version, torchvision_for(report.torch_version)
    if vision is None or wanted is None:
        return None
    labels = ("torchvision", "torchvision.ops.nms")
    failure = next((report.imports[label] for label in labels if report.imports.get(label, "ok") != "ok"), None)
    made_for, builds = torch_for(vision), (_build(vision), _build(report.torch_version))
    problems = [f"fails in a fresh Python, as in a lesson ({failure})"] if failure else []
    if made_for is not None and not report.torch_version.startswith(f"{made_for}."):
        problems.append(f"was made for torch {made_for}")
    if all(builds) and builds[0] != builds[1]:
        problems.append(f"is a {builds[0]} build where torch is a {builds[1]} build")
    if not problems:
        return None
    return (
        f"torchvision {vision} {'; it '.join(problems)} (torch {report.torch_version}). torchvision 0.(x+15) goes with "
        f"torch 2.x: install torchvision {wanted} for this torch: {torchvision_install_command(report.torch_version)}"
    )


def _import_warnings(report: Report) -> list[str]:
    """One warning per thing the lessons import that fails, the torch/torchvision pair first."""
    pair = _pair_warning(report)
    found = [pair]
    for label in report.broken:
        if pair and label.startswith("torchvision"):  # said with the pair to install
            continue
        outcome = report.imports[label]
        extra = "pip install 'gpukit[lessons]'" if label in LESSONS_EXTRA else "pip install gpukit again"
        found.append(f"{label} fails in a fresh Python, as in a lesson: {outcome}. Reinstall it ({extra}).")
    if report.import_check not in ("ok", "not run"):
        found.append(f"what the lessons import could not be checked: {report.import_check}")
    return [warning for warning in found if warning]


def warnings(report: Report) -> list[str]:
    """What looks wrong in `report`, each with what to do about it. Empty: no problems found."""
    found = _import_warnings(report)
    found += [f"gpukit.detect() failed: {report.detect_error}"] if report.detect_error else []
    found += [_driver_warning(report)]
    found += [_clock_warning(gpu) for gpu in report.gpus]
    found += [_process_warning(gpu, report.pid) for gpu in report.gpus]
    found += [_power_limit_warning(gpu) for gpu in report.gpus] + [_ecc_warning(gpu) for gpu in report.gpus]
    found += [_cpu_only_build_warning(report), _visible_devices_warning(report), _threads_warning(report)]
    found += [_load_warning(report)]
    return [warning for warning in found if warning]


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


# Where NVIDIA's Linux driver shows itself: its /proc folder and the device files it creates. (nvidia-smi on PATH,
# which comes with the driver, is the other sign; on Windows the driver puts it there too.)
NVIDIA_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/nvidia0")


def nvidia_gpu_may_be_present() -> bool:
    """True where an NVIDIA driver shows itself (its files, or nvidia-smi on PATH): where NVML could see a GPU."""
    return any(os.path.exists(path) for path in NVIDIA_DRIVER_PATHS) or shutil.which("nvidia-smi") is not None


def _nvml_facts() -> dict:
    """Driver and per-GPU facts from NVML, as Report fields. Never raises for a missing driver."""
    try:
        import pynvml  # from the nvidia-ml-py package (extra "gpu")
    except ImportError:
        if not nvidia_gpu_may_be_present():  # a laptop, a Mac, a CPU server: nothing to install
            return {"nvml": "not installed (not needed: no NVIDIA driver here)"}
        return {"nvml": "not installed (pip install nvidia-ml-py for GPU telemetry)"}
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as error:
        return {"nvml": f"no NVIDIA driver found ({error})"}
    try:
        cuda = nvml_cuda_version(pynvml)  # e.g. (12, 4)
        gpus = []
        for index in range(ask_nvml(pynvml, "nvmlDeviceGetCount") or 0):
            handle = ask_nvml(pynvml, "nvmlDeviceGetHandleByIndex", index)
            if handle is not None:  # None: e.g. a GPU the driver lost ("fallen off the bus")
                gpus.append(_gpu_status(pynvml, index, handle))
        return {
            "nvml": "ok",
            "driver_version": ask_nvml(pynvml, "nvmlSystemGetDriverVersion"),
            "driver_cuda_version": None if cuda is None else f"{cuda[0]}.{cuda[1]}",
            "gpus": gpus,
        }
    finally:
        ask_nvml(pynvml, "nvmlShutdown")


def _gpu_status(pynvml, index: int, handle) -> GPUStatus:
    def ask(name: str, *args):
        return ask_nvml(pynvml, name, handle, *args)

    memory = ask("nvmlDeviceGetMemoryInfo")
    utilization = ask("nvmlDeviceGetUtilizationRates")
    power_draw = ask("nvmlDeviceGetPowerUsage")  # mW
    power_limit = ask("nvmlDeviceGetEnforcedPowerLimit")  # mW
    power_default = ask("nvmlDeviceGetPowerManagementDefaultLimit")  # mW
    persistence = ask("nvmlDeviceGetPersistenceMode")  # NVML_FEATURE_ENABLED (1) or DISABLED (0)
    # Uncorrected errors since the driver loaded; NotSupported (None) on GPUs without ECC.
    ecc = ask(
        "nvmlDeviceGetTotalEccErrors",
        getattr(pynvml, "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", 1),
        getattr(pynvml, "NVML_VOLATILE_ECC", 0),
    )
    # The newer name first; older bindings and drivers have only the "throttle" one.
    mask = ask("nvmlDeviceGetCurrentClocksEventReasons")
    if mask is None:
        mask = ask("nvmlDeviceGetCurrentClocksThrottleReasons")
    processes = []
    for process in ask("nvmlDeviceGetComputeRunningProcesses") or []:
        used = getattr(process, "usedGpuMemory", None)  # None where the driver does not say
        name = ask_nvml(pynvml, "nvmlSystemGetProcessName", process.pid)
        processes.append(GPUProcess(int(process.pid), None if used is None else int(used), name))
    return GPUStatus(
        index=index,
        name=ask("nvmlDeviceGetName") or f"GPU {index}",
        memory_total=None if memory is None else int(memory.total),
        memory_used=None if memory is None else int(memory.used),
        utilization=None if utilization is None else int(utilization.gpu),
        temperature=ask("nvmlDeviceGetTemperature", pynvml.NVML_TEMPERATURE_GPU),  # °C
        power_draw=None if power_draw is None else power_draw / 1000,  # mW → W
        power_limit=None if power_limit is None else power_limit / 1000,
        power_limit_default=None if power_default is None else power_default / 1000,
        persistence_mode=None if persistence is None else bool(persistence),
        ecc_errors=None if ecc is None else int(ecc),
        sm_clock=ask("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_SM),  # MHz
        memory_clock=ask("nvmlDeviceGetClockInfo", pynvml.NVML_CLOCK_MEM),
        clock_reasons=clock_reasons(mask) if mask is not None else [],
        processes=processes,
    )


# What the lessons import, as (label, Python statements): gpukit's own dependencies, torchvision's compiled operators
# (its _C library: the first to fail when torch and torchvision do not belong together) and its image codecs (its
# image library), then the `lessons` extra (LESSONS_EXTRA: without it only the lessons that need it stop).
IMPORT_CHECKS = {
    "torch": "import torch",
    "torchvision": "import torchvision",
    "torchvision.ops.nms": "assert torchvision.ops.nms(torch.ones(1, 4).cumsum(1), torch.ones(1), 0.5).tolist() == [0]",
    "torchvision.io.decode_jpeg": "torchvision.io.decode_jpeg(torchvision.io.encode_jpeg(torch.zeros(3, 8, 8).byte()))",
    "numpy": "import numpy",
    "matplotlib": "import matplotlib.pyplot",
    "ipywidgets": "import ipywidgets",
    "tqdm": "import tqdm.auto",
    "cloudpickle": "import cloudpickle",
    "yaml": "import yaml",
    "webdataset": "import webdataset",
    "tensorboard": "import torch.utils.tensorboard",
    "timm": "import timm",
    "torchao": "import torchao",
    "pynvml": "import pynvml",
}
LESSONS_EXTRA = ("yaml", "webdataset", "tensorboard", "timm", "torchao", "pynvml")
IMPORT_SECONDS = 300  # all of it took 8-15 s on two busy cores (timm and torchao ~10 s each alone, sharing most)

# Run in a fresh Python: one line per label as soon as it is known, so that a crash still names what it was trying.
_PROBE = """
import importlib.util, json, sys
failed = set()
for label, statement in json.loads(sys.argv[1]).items():
    if label.split(".")[0] in failed:  # torchvision's operators, where torchvision itself fails: said once
        continue
    print("trying " + label, flush=True)
    try:
        exec(statement)
        outcome = "ok"
    except ModuleNotFoundError as error:
        top = (error.name or "").split(".")[0]
        missing = top and importlib.util.find_spec(top) is None
        outcome = f"not installed ({top})" if missing else f"ModuleNotFoundError: {error}"
    except Exception as error:  # a probe: whatever a broken install raises (ImportError, OSError, RuntimeError, ...)
        first = str(error).strip().splitlines()[:1]
        outcome = type(error).__name__ + (": " + first[0][:300] if first else "")
    if outcome != "ok":
        failed.add(label)
    print("outcome " + json.dumps([label, outcome]), flush=True)
"""


def import_check(seconds: float = IMPORT_SECONDS) -> tuple[dict[str, str], str]:
    """(label → outcome for IMPORT_CHECKS, "ok" or why the check gave no answer), from a fresh Python.

    A fresh process, as a lesson's kernel: a broken library can neither leave this one half-imported nor crash it,
    and CUDA stays untouched here. torchvision's checks are skipped where torchvision itself fails."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE, json.dumps(IMPORT_CHECKS)],
            capture_output=True,
            text=True,
            timeout=seconds,
        )
    except subprocess.TimeoutExpired as error:
        found, trying = _probe_lines(error.stdout)
        return found, f"did not finish in {seconds:.0f} s (it was importing {trying})"
    found, trying = _probe_lines(done.stdout)
    if trying is not None:  # the process died on it: a segmentation fault in a compiled library, say
        found[trying] = f"crashed the Python process (exit code {done.returncode})"
    return found, "ok"


def _probe_lines(stdout: str | bytes | None) -> tuple[dict[str, str], str | None]:
    """The outcomes the probe printed, and the label it was trying when it stopped (None: it finished)."""
    text = stdout.decode(errors="replace") if isinstance(stdout, bytes) else stdout or ""
    found, trying = {}, None
    for line in text.splitlines():
        if line.startswith("trying "):
            trying = line[len("trying ") :]
        elif line.startswith("outcome "):
            label, outcome = json.loads(line[len("outcome ") :])
            found[label], trying = outcome, None
    return found, trying


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
