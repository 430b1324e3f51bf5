"""The GPUs as NVML (the driver's management library) sees them, without initialising CUDA: each GPU's state
(`GPUStatus`, the processes holding its memory), read by `_nvml_facts`, and what looks wrong with one GPU (its clocks,
other processes, its power limit, ECC errors), each rule a pure function of a GPUStatus."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass, field

from ..env import ask_nvml, nvml_cuda_version
from ..hardware.clocks import BENIGN_CLOCK_REASONS, clock_reasons
from ..hardware.gpus import find_gpu
from ..report import format_bytes

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
# What looks wrong with one GPU


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


# ---------------------------------------------------------------------------------------------
# Reading them from NVML


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
