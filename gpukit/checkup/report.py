"""The doctor's `Report`: facts about this environment, shown as tables, and `warnings(report)`: what looks wrong
in them, each with what to do, derived from the facts alone so that every rule can be tested on a CPU with a
fabricated report (the rules about one GPU are gpukit/checkup/nvml.py's)."""

from __future__ import annotations

import html
import os
from dataclasses import dataclass, field

from ..env import cpu_threads, cuda_build_problem
from ..report import Table, format_bytes
from .imports import LESSONS_EXTRA, _build, torch_for, torchvision_for, torchvision_install_command
from .nvml import GPUStatus, _clock_warning, _datasheet, _ecc_warning, _number, _power_limit_warning, _process_warning


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
