"""gpukit: learn and measure fast neural-network training on GPUs with PyTorch.

Importing gpukit never initialises CUDA, so a notebook can still launch worker processes
that use the GPU afterwards.
"""

from . import (
    bench,
    compiling,
    data,
    distributed,
    fp8,
    hardware,
    inference,
    memory,
    models,
    optim,
    plots,
    preemption,
    shipped,
    step,
    train,
)
from .checkup import doctor
from .claims import CheckFailed, check, check_between, skip_check
from .deprecation import renamed
from .env import PROFILES, Env, Profile, detect, resolve_device, seed_everything
from .precision import PRECISIONS, Precision, get_precision
from .report import Table, format_bytes
from .step.builtin_losses import CrossEntropy
from .train import (
    CheckpointError,
    History,
    ModelTransforms,
    NonFiniteLossError,
    Reporting,
    Saving,
    evaluate,
    fit,
    lr_find,
)

__version__ = "0.1.0"

__all__ = [
    "PRECISIONS",
    "PROFILES",
    "CheckFailed",
    "CheckpointError",
    "CrossEntropy",
    "Env",
    "History",
    "ModelTransforms",
    "NonFiniteLossError",
    "Precision",
    "Profile",
    "Reporting",
    "Saving",
    "Table",
    "bench",
    "check",
    "check_between",
    "compiling",
    "data",
    "detect",
    "distributed",
    "doctor",
    "evaluate",
    "fit",
    "format_bytes",
    "fp8",
    "get_precision",
    "hardware",
    "inference",
    "lr_find",
    "memory",
    "models",
    "optim",
    "plots",
    "preemption",
    "resolve_device",
    "seed_everything",
    "shipped",
    "skip_check",
    "step",
    "train",
]

# gk.checkpointing was activation checkpointing; "checkpoint" alone now means saved training state.
__getattr__ = renamed(__name__, {"checkpointing": "gpukit.memory:activation_checkpointing"})
