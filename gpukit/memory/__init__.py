"""Training memory: measure it, break it down, predict it, find the batch that fits, and fix it.

measure()          peak memory of a block of code (measuring.py).
allocator_peak()   the peak of a function's allocations as the allocator itself reports them (CUDA's statistics,
                   or c10's CPU allocator through torch.profiler): an independent check of the counts below.
cublas_workspace_bytes()  one cuBLAS(Lt) workspace: taken from the caching allocator, counted as allocated;
allocate_cublas_workspaces() has cuBLAS take them now (this thread's and autograd's), before a measurement.
allocator_slack_for()     the most the CUDA caching allocator counts beyond live tensors of given sizes (counting.py).
breakdown()        one training step measured: parameters, gradients, optimizer state, saved
                   activations, the rest, the peak (measuring.py); the step itself, as fit runs it, with
                   a mark at each phase, and the checks of the model and batch given (measured_step.py).
estimate()         the same fields predicted with fake tensors: nothing runs on the device (prediction.py);
                   fused kernels' workspaces that fake tensors miss, such as oneDNN's LSTM (fused_workspaces.py).
saved_bytes()      the bytes autograd saves in one real forward pass and loss, counted with PyTorch's own
                   saved-tensor hooks and nothing of the above: an independent check (autograd_hooks.py).
layer_workspaces() on a CUDA GPU, the scratch memory each layer takes inside its operators (cuDNN's
                   convolution workspaces), which no prediction from tensors includes (workspaces.py).
optimizer_state_bytes()  the optimizer state each optimizer name keeps, from the parameters (prediction.py).
max_batch_size()   the largest batch under a memory budget; accumulation keeps a global batch (plan.py).
MemoryBreakdown, breakdown_table(), plot_breakdowns(), plot_memory_timeline(): the parts and their
figures (parts.py).
The CUDA allocator: out-of-memory help, free_memory, limit_gpu_memory, expandable_segments,
record_snapshot (allocator.py).
apply_activation_checkpointing(): recompute each block's activations in backward instead of keeping
them, all of them (policy="full") or all but the matmul and attention outputs (policy="selective")
(activation_checkpointing.py; a model's blocks: blocks.py; a region recomputed in backward: recomputation.py).
"Checkpoint" alone, in gpukit, means saved training state.
OffloadActivations, offload_cost(): saved activations kept in host memory, and the PCIe traffic that
costs (offload.py).

Every function takes an example batch of any form fit accepts (see gpukit.step), or a tensor of
inputs with optional labels. Every byte count is of tensor storages, each counted once.
"""

from ..deprecation import renamed
from . import activation_checkpointing
from .activation_checkpointing import (
    ActivationCheckpointingPlan,
    apply_activation_checkpointing,
    find_blocks,
    has_activation_checkpointing,
    remove_activation_checkpointing,
)
from .allocator import (
    Snapshot,
    TrainingOutOfMemoryError,
    expandable_segments,
    free_memory,
    limit_gpu_memory,
    record_snapshot,
)
from .autograd_hooks import saved_bytes
from .counting import allocator_slack_for
from .measuring import (
    Measurement,
    allocate_cublas_workspaces,
    allocator_peak,
    breakdown,
    cublas_workspace_bytes,
    measure,
)
from .offload import OffloadActivations, OffloadCost, offload_cost
from .parts import MemoryBreakdown, breakdown_table, plot_breakdowns, plot_memory_timeline
from .plan import BatchSizePlan, max_batch_size
from .prediction import OPTIMIZER_STATE, estimate, optimizer_state_bytes
from .workspaces import layer_workspaces

__all__ = [
    "OPTIMIZER_STATE",
    "BatchSizePlan",
    "ActivationCheckpointingPlan",
    "Measurement",
    "MemoryBreakdown",
    "OffloadActivations",
    "OffloadCost",
    "Snapshot",
    "TrainingOutOfMemoryError",
    "activation_checkpointing",
    "allocate_cublas_workspaces",
    "allocator_peak",
    "allocator_slack_for",
    "apply_activation_checkpointing",
    "breakdown",
    "cublas_workspace_bytes",
    "breakdown_table",
    "estimate",
    "expandable_segments",
    "find_blocks",
    "free_memory",
    "has_activation_checkpointing",
    "layer_workspaces",
    "limit_gpu_memory",
    "max_batch_size",
    "measure",
    "offload_cost",
    "optimizer_state_bytes",
    "plot_breakdowns",
    "plot_memory_timeline",
    "record_snapshot",
    "remove_activation_checkpointing",
    "saved_bytes",
]

__getattr__ = renamed(
    __name__,
    {
        "checkpointing": "gpukit.memory:activation_checkpointing",
        "table": "gpukit.memory.parts:breakdown_table",
        "plot_timeline": "gpukit.memory.parts:plot_memory_timeline",
        "CUDA_BLOCK": "gpukit.memory.counting:CUDA_BLOCK",
        "out_of_memory_error": "gpukit.memory.allocator:out_of_memory_error",
        "watch_out_of_memory": "gpukit.memory.allocator:watch_out_of_memory",
    },
)
