"""Hardware: the GPU table, which GPU fits your model and what a run costs, and watching a GPU work.

gpus.py        one table of NVIDIA GPUs from their datasheets (memory, bandwidth, dense TFLOP/s,
               compute capability, TDP); find_gpu / get_gpu / add_gpu.
clocks.py      NVML's clock-event reasons in words (why a GPU runs below its maximum clocks).
planning.py    plan(): what fits each GPU, the largest batch, step time from a roofline, time and
               cost of a run, the Pareto frontier; checked against a measured run here.
roofline.py    a step's time on each GPU (FLOPs, bytes moved, kernel launches) and the plan's rows.
calibration.py the MFU measured on the machine present, and the plan's check against it.
monitor.py     Monitor: a background NVML sampler (utilisation, memory, power, temperature, clocks,
               throttle reasons) and energy per epoch; CO₂ from a grid intensity you set.
contention.py  measure_contention(): two training processes sharing one device against one alone.

The two tables load with this package; planning, monitor and contention load on first use, so that
lower layers (gk.bench, the doctor) can read the tables without importing what builds on them.
"""

import importlib

from ..deprecation import renamed
from .clocks import BENIGN_CLOCK_REASONS, CLOCK_REASONS, clock_reasons
from .gpus import GPU, GPUS, add_gpu, find_gpu, get_gpu, gpu_table, reset_gpus

_LAZY = {
    "contention": ("ContentionResult", "measure_contention"),
    "monitor": ("DEFAULT_GRID_INTENSITY", "Monitor", "MonitorUnavailable"),
    "planning": ("PRICES", "PRICES_DATE", "PRICES_SOURCE", "TYPICAL_MFU", "Plan", "PlanRow", "plan"),
}
_HOME = {name: module for module, names in _LAZY.items() for name in names}

__all__ = [
    "BENIGN_CLOCK_REASONS",
    "CLOCK_REASONS",
    "GPU",
    "GPUS",
    "add_gpu",
    "clock_reasons",
    "find_gpu",
    "get_gpu",
    "gpu_table",
    "reset_gpus",
    *_HOME,
]


def __getattr__(name: str):
    if name in _HOME:
        return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
    if name in _LAZY:  # the submodule itself, as `gk.hardware.planning`
        return importlib.import_module(f"{__name__}.{name}")
    return _renamed(name)


_renamed = renamed(
    __name__, {"table": "gpukit.hardware.gpus:gpu_table", "PRECISION_NAMES": "gpukit.precision:MATMUL_FORMAT"}
)


def __dir__() -> list[str]:
    return sorted([*globals(), *_HOME, *_LAZY])
