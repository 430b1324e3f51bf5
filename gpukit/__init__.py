"""gpukit: learn and measure fast neural-network training on GPUs with PyTorch.

Importing gpukit never initialises CUDA, so a notebook can still launch worker processes
that use the GPU afterwards.
"""

from . import bench, checkpointing, data, distributed, memory, models, plots
from .doctor import doctor
from .env import PROFILES, Env, Profile, detect, resolve_device, seed_everything
from .precision import PRECISIONS, Precision, get_precision
from .report import Table, format_bytes
from .train import History, NonFiniteLossError, evaluate, fit

__version__ = "0.1.0"

__all__ = [
    "PRECISIONS", "PROFILES", "Env", "History", "NonFiniteLossError", "Precision", "Profile", "Table",
    "bench", "data", "detect", "doctor", "plots", "evaluate", "fit", "format_bytes", "get_precision", "models",
    "checkpointing", "distributed", "memory", "resolve_device", "seed_everything",
]  # fmt: skip
