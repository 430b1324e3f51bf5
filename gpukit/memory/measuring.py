"""Measure training memory: the peak of a block of code, and one training step broken down.

measure()     peak memory of a block of code. On CUDA, the caching allocator's statistics
              (allocated, reserved, and the cache between them); elsewhere, the bytes of
              tensor storages alive, tracked operator by operator.
allocator_peak()  the peak of a function's allocations as the device's allocator itself reports them (CUDA's
              statistics; on a CPU, c10's allocator through torch.profiler): shares no code with the counting of
              tensors above, so it can check it.
breakdown()   one training step measured: parameters, gradients, optimizer state,
              activations saved for backward (saved-tensor hooks), the rest, the peak; on
              CUDA also the workspace held only inside operators (cuDNN's, above all).

The step is gpukit.step's TrainStep, the one fit runs, on a batch of any form (measured_step.py).
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile
from torch.utils._pytree import tree_leaves

from ..data.timeline import quiet_kineto_without_cuda
from ..env import resolve_device
from ..precision import Precision, get_precision
from ..report import format_bytes
from ..step import Batch, Loss, TrainStep
from .counting import CUDA_BLOCK, CUDA_UNSPLIT, LiveTensors, keeps_generators
from .measured_step import (
    CannotSimulateError,
    MeasuredStep,
    build_optimizer,
    check_model,
    compact,
    does_not_fit,
    sample_batch,
)
from .parts import MemoryBreakdown

__all__ = [
    "CannotSimulateError",
    "MeasuredStep",
    "Measurement",
    "allocate_cublas_workspaces",
    "allocator_peak",
    "breakdown",
    "build_optimizer",
    "check_model",
    "compact",
    "cublas_workspace_bytes",
    "does_not_fit",
    "measure",
    "measured_instead",
    "sample_batch",
]

# ---------------------------------------------------------------------------------------------
# Measure


@dataclass
class Measurement:
    """Peak memory of the code inside `measure()`, in bytes.

    peak, end:        bytes above the start, at the peak and when the block ended.
    peak_allocated:   CUDA only: torch.cuda.max_memory_allocated, absolute.
    peak_reserved:    CUDA only: torch.cuda.max_memory_reserved, absolute: what the caching
                      allocator held from the driver, including its cache.
    """

    device: str
    source: str
    peak: int = 0
    end: int = 0
    peak_allocated: int | None = None
    peak_reserved: int | None = None

    @property
    def allocator_cache(self) -> int | None:
        """Reserved but not allocated at the peaks: memory the allocator keeps for reuse."""
        if self.peak_reserved is None or self.peak_allocated is None:
            return None
        return self.peak_reserved - self.peak_allocated

    def __str__(self) -> str:
        text = f"peak {format_bytes(self.peak)} above the start on {self.device} ({self.source})"
        if self.peak_reserved is not None:
            text += f"; peak allocated {format_bytes(self.peak_allocated)}, reserved {format_bytes(self.peak_reserved)}"
        return text


_TRACKED = "tensor storages alive, tracked per operator"
_ALLOCATOR = "CUDA caching allocator statistics"


@contextlib.contextmanager
def measure(device: str | torch.device | None = None) -> Iterator[Measurement]:
    """Measure the peak memory of the code inside, on `device` (default: the best available).

    On CUDA this reads the caching allocator's peak statistics (after synchronising). On a
    CPU there are no such statistics: it counts the bytes of tensor storages alive after every
    operator, for tensors created inside the block; memory that C libraries use inside an
    operator is not included. The Measurement is filled in when the block ends.

        with gk.memory.measure("cuda") as used:
            loss = model(images).sum(); loss.backward()
        print(used.peak)
    """
    device = resolve_device(device)
    if device.type == "cuda":
        result = Measurement(str(device), _ALLOCATOR)
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        try:
            yield result
        finally:
            torch.cuda.synchronize(device)
            result.peak_allocated = torch.cuda.max_memory_allocated(device)
            result.peak_reserved = torch.cuda.max_memory_reserved(device)
            result.peak = result.peak_allocated - start
            result.end = torch.cuda.memory_allocated(device) - start
        return
    result = Measurement(str(device), f"{_TRACKED} (tensors created inside the block)")
    tracker = LiveTensors(device.type)
    try:
        with tracker:
            yield result
    finally:
        result.peak, result.end = tracker.peak, tracker.bytes


def allocator_peak(function: Callable[[], object], device: str | torch.device | None = None) -> int:
    """The most bytes `device`'s allocator held at once while `function()` ran, above what it held at the start.

    Every allocation counts: tensors, and the scratch memory an operator takes and frees inside itself (oneDNN's, in
    a convolution's or an LSTM's kernels), which no count of tensors sees. It shares no code with gk.memory's counting of tensors
    (measure() on a CPU, breakdown(), estimate()), so it can check them. On CUDA: torch.cuda.max_memory_allocated
    after resetting the peak, less memory_allocated at the start (the caching allocator's 512-byte blocks). On a CPU:
    c10's CPU allocator reports each allocation and free, with its address and bytes, to torch.profiler
    (profile_memory=True), on the threads the profiler follows (the caller's, and autograd's); the peak of their
    running sum in time order, counting only the blocks allocated inside (a block allocated before is neither added
    nor taken away when it is freed).
    """
    device = resolve_device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        function()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - start
    if device.type != "cpu":
        raise ValueError(
            f"allocator_peak reads CUDA's allocator statistics or the CPU allocator's reports, not {device.type}'s; "
            "measure on device='cpu' or 'cuda', or use gk.memory.measure() there."
        )
    with quiet_kineto_without_cuda(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as profiler:
        function()
    return _running_peak(_allocations(profiler.profiler.kineto_results.experimental_event_tree()))


def _allocations(roots) -> list[tuple[int, int, int]]:
    """(time in ns, address, bytes: + allocated, - freed) of every CPU allocator event in a profiler's event tree,
    in time order (events of the same nanosecond in the tree's order: an operator's, then its children's)."""
    events, stack = [], list(reversed(roots))
    while stack:
        event = stack.pop()
        stack.extend(reversed(event.children))
        if event.tag == torch._C._profiler._EventType.Allocation:
            fields = event.typed[1]
            if fields.device.type == "cpu":
                events.append((event.start_time_ns, fields.ptr, fields.alloc_size))
    return sorted(events, key=lambda event: event[0])  # a stable sort


def _running_peak(events: list[tuple[int, int, int]]) -> int:
    """The peak of the bytes allocated inside the window still alive, over `events` in time order."""
    alive: dict[int, int] = {}  # address -> bytes, of the blocks allocated inside the window
    now = peak = 0
    for _, address, size in events:
        if size > 0:
            alive[address] = size
            now += size
        elif address in alive:  # a free of a block allocated before the window is not in the sum
            now -= alive.pop(address)
        peak = max(peak, now)
    return peak


# ---------------------------------------------------------------------------------------------
# One training step, measured (the step itself: measured_step.py)


def cublas_workspace_bytes() -> int:
    """One cuBLAS (and cuBLASLt) workspace, which PyTorch takes from the caching allocator per thread and stream,
    on the current CUDA device."""
    getters = [
        getattr(torch._C, name, None) for name in ("_cuda_getCublasWorkspaceSize", "_cuda_getCublasLtWorkspaceSize")
    ]
    if all(getters):  # torch 2.14 says; torch 2.11 has neither getter (read from its libtorch_python.so)
        return sum(getter() for getter in getters)
    cublas = _chosen_cublas_workspace_bytes(torch.cuda.get_device_capability())
    return cublas + _cublaslt_workspace_bytes(cublas)


def _chosen_cublas_workspace_bytes(capability: tuple[int, int]) -> int:
    """cuBLAS's workspace as torch chooses it (CublasHandlePool.cpp): CUBLAS_WORKSPACE_CONFIG's ":KiB:COUNT" pairs
    summed, else 32 MiB on Hopper (compute capability 9.0) and 8 MiB + 128 KiB elsewhere."""
    default = 4096 * 8 * 1024 if tuple(capability) == (9, 0) else 4096 * 1024 * 2 + 16 * 1024 * 8
    pairs = re.findall(r":([0-9]+):([0-9]+)", os.environ.get("CUBLAS_WORKSPACE_CONFIG", ""))
    return sum(int(kib) * 1024 * int(count) for kib, count in pairs) if pairs else default


def _cublaslt_workspace_bytes(cublas: int) -> int:
    """cuBLASLt's workspace as torch chooses it: CUBLASLT_WORKSPACE_SIZE KiB (default 1,024), at most cuBLAS's."""
    kib = os.environ.get("CUBLASLT_WORKSPACE_SIZE", "1024")
    return min(int(kib) * 1024 if kib.strip().isdigit() else 1024 * 1024, cublas)


def allocate_cublas_workspaces(device: torch.device) -> None:
    """Make cuBLAS take its workspaces now, so that no measured step takes them.

    cuBLAS takes a workspace from the caching allocator on its first GEMM per thread and stream, and keeps it:
    32 MiB each on Hopper, one for the forward's thread and one for autograd's backward thread. Taken inside the
    first step measured in a process, they count as that step's memory: the H100 run of 2026-11-24 found the first
    case of benchmarks/memory_estimate.py exactly 64 MiB above its prediction, and every later case exact.
    """
    weight = torch.ones(8, 8).to(device).requires_grad_()  # made on the host and copied: tiny
    # With a bias (cuBLASLt's GEMM) and without (cuBLAS's), on this thread; their backward's GEMMs on autograd's.
    linear = torch.nn.functional.linear
    (linear(weight, weight, weight[0]) + linear(weight, weight)).sum().backward()
    del weight


def _refuse_meta(batch: Batch) -> None:
    """A batch on the meta device has shapes but no values, and breakdown runs a real step on it ("Cannot copy out of
    meta tensor"): said, with the function that takes shapes alone."""
    meta = [tensor for tensor in tree_leaves((batch.args, batch.kwargs, batch.target)) if _is_meta(tensor)]
    if meta:
        raise ValueError(
            f"the batch holds {len(meta)} tensor(s) on the meta device (shapes without values, e.g. "
            f"{tuple(meta[0].shape)} {str(meta[0].dtype).removeprefix('torch.')}), and breakdown measures a real step. "
            "Pass gk.memory.estimate the same batch to predict its memory from the shapes alone, or give breakdown a "
            "real batch of those shapes: torch.zeros_like(tensor, device='cpu') (values do not change memory)."
        )


def _is_meta(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_meta


@keeps_generators
def breakdown(
    model: nn.Module,
    batch,
    labels: torch.Tensor | None = None,
    *,
    optimizer: str | Callable = "nesterov",
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    loss_fn: str | Callable | None = None,
    set_to_none: bool = True,
) -> MemoryBreakdown:
    """Measure where the memory of one training step goes.

    `batch` is an example batch of any form fit accepts ((inputs, target), a dict, …; see
    gpukit.step), or a tensor of inputs with `labels` (default class 0: values do not change
    memory). It is copied once, so a slice of a larger tensor counts as the batch it is.
    Trains a copy of `model` (yours is not changed) for two steps on `device`, as fit() does,
    and measures the second, which starts from the steady state (optimizer state present).
    Parameters, gradients, optimizer state and saved activations are counted from the tensors
    themselves; the peak comes from the CUDA allocator on a GPU, and from tensor storages
    tracked per operator elsewhere. On a GPU the peak also holds library workspaces, memory
    taken and freed inside one operator (cuDNN's convolution workspaces): reported as
    `workspace`, the peak minus the allocator's highest count after any operator.
    `set_to_none=False` keeps zeroed gradients between steps.
    """
    check_model(model)
    batch = sample_batch(model, batch, labels)
    _refuse_meta(batch)
    device = resolve_device(device)
    precision = get_precision(precision, device)
    cuda = device.type == "cuda"
    if cuda:
        allocate_cublas_workspaces(device)  # before the baseline: they are the process's, not this step's
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)  # what this step does not own
    copied = copy.deepcopy(model).to(device).train()
    built, optimizer_name = build_optimizer(optimizer, copied, foreach=None)
    step = TrainStep(copied, built, precision, Loss(loss_fn), set_to_none=set_to_none)
    measured = MeasuredStep(copied, compact(batch, device), step)
    if cuda:  # tensors counted in the allocator's 512-byte blocks, beside the allocator's own count
        tracker = LiveTensors("cuda", CUDA_BLOCK, lambda: torch.cuda.memory_allocated(device) - baseline)
    else:
        tracker = LiveTensors(device.type)
    with precision.flags():
        measured.warm_up()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        grads, optimizer_state, saved = measured.measure(tracker)
    fields = {"total": tracker.peak, "source": f"measured on {device.type.upper()}: {_TRACKED}"}
    if cuda:
        torch.cuda.synchronize(device)
        peak_allocated = torch.cuda.max_memory_allocated(device)
        fields = {
            "total": peak_allocated - baseline,
            "source": "measured on CUDA: torch.cuda.max_memory_allocated",
            "allocator_cache": torch.cuda.max_memory_reserved(device) - peak_allocated,
            "allocated_timeline": list(tracker.allocator_samples),
            # At most 1 MiB per live storage over 1 MiB (allocator_slack_for); cuBLAS's workspaces were taken before
            # the baseline (allocate_cublas_workspaces), so a step that takes them again is a miss, not slack.
            "allocator_slack": tracker.most_large_storages * CUDA_UNSPLIT,
        }
    return measured.result(
        tracker,
        grads,
        optimizer_state,
        saved,
        device=device.type,
        precision=precision.name,
        optimizer=optimizer_name,
        **fields,
    )


def measured_instead(
    model: nn.Module, batch: Batch, sizes: list[int], reason: str, *, device: torch.device, **options
) -> list[MemoryBreakdown]:
    """What gk.memory.estimate gives where fake tensors cannot run the model: one real training step measured
    (breakdown(), on a copy of the model) per batch size, the sample's examples taken in turn to make each size
    (real values: a detector's boxes stay boxes), on the device the prediction was for. A warning says so, and
    each result's `source` says why."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(
            f"{reason}; a real step could be measured instead, but there is no CUDA device here: measure it on the "
            "GPU machine, or here with device='cpu'."
        )
    warnings.warn(
        f"gk.memory.estimate: {reason}; measured one real training step per batch size on {device} instead (a copy "
        "of your model trained for two steps, as breakdown() does: yours is unchanged).",
        stacklevel=3,
    )
    cuda = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):  # a detector samples proposals: not from yours
        results = [breakdown(model, batch.repeated(size), device=device, **options) for size in sizes]
    for result in results:
        result.source += f" (instead of a prediction: {reason})"
    return results
