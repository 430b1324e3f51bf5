"""Hardware: the GPU table, which GPU fits your model and what a run costs, and watching a GPU work.

gpus.py        one table of NVIDIA GPUs from their datasheets (memory, bandwidth, dense TFLOP/s,
               compute capability, TDP); find_gpu / get_gpu / add_gpu.
planning.py    plan(): what fits each GPU, the largest batch, step time from a roofline, time and
               cost of a run, the Pareto frontier; checked against a measured run here.
monitor.py     Monitor: a background NVML sampler (utilisation, memory, power, temperature, clocks,
               throttle reasons) and energy per epoch; CO₂ from a grid intensity you set.
contention.py  measure_contention(): two training processes sharing one device against one alone.

gk.bench and gk.doctor read the table too; they import it inside their functions, because this
package's modules import gk.bench and gk.memory (which load before it).
"""

from .contention import ContentionResult, measure_contention
from .gpus import GPU, GPUS, PRECISION_NAMES, add_gpu, find_gpu, get_gpu, reset_gpus, table
from .monitor import DEFAULT_GRID_INTENSITY, Monitor, MonitorUnavailable, clock_reasons
from .planning import PRICES, PRICES_DATE, PRICES_SOURCE, TYPICAL_MFU, Plan, PlanRow, plan

__all__ = [
    "DEFAULT_GRID_INTENSITY", "GPU", "GPUS", "PRECISION_NAMES", "PRICES", "PRICES_DATE", "PRICES_SOURCE",
    "TYPICAL_MFU", "ContentionResult", "Monitor", "MonitorUnavailable", "Plan", "PlanRow", "add_gpu",
    "clock_reasons", "find_gpu", "get_gpu", "measure_contention", "plan", "reset_gpus", "table",
]  # fmt: skip
