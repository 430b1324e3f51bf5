"""Training memory: measure it, break it down, predict it, find the batch that fits, and fix it.

measure()          peak memory of a block of code (measure.py).
breakdown()        one training step measured: parameters, gradients, optimizer state, saved
                   activations, the rest, the peak (measure.py).
estimate()         the same fields predicted with fake tensors: nothing runs on the device (estimate.py).
optimizer_state_bytes()  the optimizer state each optimizer name keeps, from the parameters (estimate.py).
max_batch_size()   the largest batch under a memory budget; accumulation keeps a global batch (plan.py).
MemoryBreakdown, table(), plot_breakdowns(), plot_timeline(): the parts and their figures (parts.py).
The CUDA allocator: out-of-memory help, free_memory, limit_gpu_memory, expandable_segments,
record_snapshot (allocator.py); activation checkpointing (checkpointing.py).

Every function takes an example batch of any form fit accepts (see gpukit.step), or a tensor of
inputs with optional labels. Every byte count is of tensor storages, each counted once.
"""

from . import checkpointing
from .allocator import (
    Snapshot,
    TrainingOutOfMemoryError,
    expandable_segments,
    free_memory,
    limit_gpu_memory,
    out_of_memory_error,
    record_snapshot,
    watch_out_of_memory,
)
from .estimate import CUDA_BLOCK, OPTIMIZER_STATE, estimate, optimizer_state_bytes
from .measure import Measurement, breakdown, measure
from .parts import MemoryBreakdown, plot_breakdowns, plot_timeline, table
from .plan import BatchSizePlan, max_batch_size

__all__ = [
    "CUDA_BLOCK", "OPTIMIZER_STATE", "BatchSizePlan", "Measurement", "MemoryBreakdown", "Snapshot", "TrainingOutOfMemoryError",
    "breakdown", "checkpointing", "estimate", "expandable_segments", "free_memory", "limit_gpu_memory",
    "max_batch_size", "measure", "optimizer_state_bytes", "out_of_memory_error", "plot_breakdowns", "plot_timeline", "record_snapshot",
    "table", "watch_out_of_memory",
]  # fmt: skip
