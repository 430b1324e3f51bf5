"""Measure training memory: the peak of a block of code, and one training step broken down.

measure()     peak memory of a block of code. On CUDA, the caching allocator's statistics
              (allocated, reserved, and the cache between them); elsewhere, the bytes of
              tensor storages alive, tracked operator by operator.
breakdown()   one training step measured: parameters, gradients, optimizer state,
              activations saved for backward (saved-tensor hooks), the rest, the peak; on
              CUDA also the workspace held only inside operators (cuDNN's, above all).

The step is gpukit.step's TrainStep, the one fit runs, on a batch of any form.
"""

from __future__ import annotations

import contextlib
import copy
import os
import re
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ..env import resolve_device
from ..optim import make_optimizer
from ..precision import Precision, get_precision
from ..report import format_bytes
from ..step import Batch, Loss, TrainStep, split_batch, unpack_outputs
from .counting import (
    CUDA_BLOCK,
    CUDA_UNSPLIT,
    LiveTensors,
    SavedTensors,
    dense_parts,
    keeps_generators,
    optimizer_tensors,
    storage_bytes,
    storage_of,
)
from .parts import MemoryBreakdown

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


# ---------------------------------------------------------------------------------------------
# One training step, measured


def check_model(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    if not any(True for _ in model.parameters()):
        raise ValueError(
            "the model has no parameters, so training it uses no memory for weights, gradients or optimizer "
            "state; pass the model you mean to train."
        )


def sample_batch(model: nn.Module, batch, labels: torch.Tensor | None = None) -> Batch:
    """The example batch a memory function was given, as a Batch of any form (see gpukit.step).

    `labels` joins a tensor of inputs as its target (the older `(model, images, labels)` call).
    A tensor alone gets class 0 as the target of every example (values do not change memory),
    shaped like the model's outputs without their last (class) dimension.
    """
    if labels is not None:
        batch = (batch, labels)
    elif isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] == 0:
            raise ValueError(f"the sample must be a batch with at least one example, got shape {tuple(batch.shape)}.")
        batch = (batch, torch.zeros(_output_shape(model, batch)[:-1], dtype=torch.long))
    batch = split_batch(batch)
    if batch.size == 0:
        raise ValueError("the sample batch is empty; give it at least one example.")
    return batch


def _output_shape(model: nn.Module, inputs: torch.Tensor) -> torch.Size:
    """The shape of the model's prediction for `inputs`, from a copy on the meta device (no compute)."""
    meta = copy.deepcopy(model).to("meta")
    with torch.no_grad():
        try:
            prediction, _ = unpack_outputs(meta(inputs.to("meta")))
        except RuntimeError as error:
            raise does_not_fit(Batch((inputs,), {}, None, len(inputs)), error) from error
    if prediction is None:
        raise ValueError("the model returns no prediction to build a target for; pass a whole batch (inputs, target).")
    return prediction.shape


def compact(batch: Batch, device: torch.device) -> Batch:
    """The batch on `device`, each tensor in storage of its own.

    A slice of a larger tensor (x[:32] of a dataset) keeps the whole tensor's storage alive;
    counted as saved for backward, it would make the step look as large as the dataset. A
    loader's batch is a tensor of its own, so the sample is copied once, as a loader would.
    """

    def own(tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.to(device)
        whole = tensor.storage_offset() == 0 and tensor.untyped_storage().nbytes() == tensor.nbytes
        return tensor if whole else tensor.clone()

    return batch.map(own)


def does_not_fit(batch: Batch, error: Exception) -> ValueError:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    shapes = ", ".join(str(tuple(t.shape)) for t in batch.tensors())
    return ValueError(
        f"the sample batch (tensors of shapes {shapes}) does not fit the model ({first_line}). Pass a batch shaped "
        "like the model's training data, e.g. (batch, 3, 32, 32) images for the kit's CNNs."
    )


class CannotSimulateError(ValueError):
    """Fake tensors cannot run the model: an operation's result depends on tensor values. `reason` says which,
    without the advice that follows it in the message."""

    def __init__(self, reason: str, advice: str = ""):
        super().__init__(reason + advice)
        self.reason = reason


def _cannot_simulate(error: Exception) -> CannotSimulateError:
    return CannotSimulateError(
        f"the model runs an operation that fake tensors cannot simulate ({type(error).__name__}: "
        f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}), usually one whose result depends on "
        "tensor values",
        "; measure it with gk.memory.breakdown() on a small batch instead.",
    )


def build_optimizer(optimizer, model: nn.Module, foreach: bool | None) -> tuple[torch.optim.Optimizer, str]:
    """fit's optimizer for `model` (so the memory matches fit's), and its name."""
    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "pass the optimizer as a name ('nesterov', 'adamw', ...) or a function of the parameters: an Optimizer "
            "object is tied to one model's parameters, and memory is measured on a copy."
        )
    built = make_optimizer(optimizer, model, lr=1e-3, weight_decay=5e-4)
    if foreach is not None:  # CUDA optimizers default to foreach kernels, whose temporaries count
        for group in built.param_groups:
            group["foreach"] = foreach
    return built, optimizer if isinstance(optimizer, str) else type(built).__name__


@dataclass
class MeasuredStep:
    """One training step (gpukit.step.TrainStep, as fit runs it) with hooks to measure each phase,
    on real or fake tensors."""

    model: nn.Module
    batch: Batch
    step: TrainStep
    gradient_serials: set = field(default_factory=set, init=False)  # the tracker's serials of the gradients
    at_peak: dict[str, int] = field(default_factory=dict, init=False)  # bytes of each part alive at the peak

    def run(self, tracker: LiveTensors | None = None, saved: SavedTensors | None = None) -> int:
        """Forward, backward, optimizer step, zero_grad; returns the gradients' bytes."""
        mark = tracker.start_phase if tracker is not None else lambda name: None
        mark("forward")
        with saved.counting() if saved is not None else contextlib.nullcontext():
            loss, _, _ = self.step.forward(self.batch)
        mark("backward")
        self.step.backward(loss)
        del loss  # frees the graph's last references before the optimizer step, as in fit
        gradients = [p.grad for p in self.model.parameters() if p.grad is not None]
        grads = storage_bytes(gradients)
        if tracker is not None:
            self.gradient_serials = {
                tracker.serial_of(part) for gradient in gradients for part in dense_parts(gradient)
            }
        del gradients  # zero_grad(set_to_none=True) must free them, as in fit
        mark("optimizer step")
        self.step.step()
        return grads

    def warm_up(self) -> None:
        """The first step creates the optimizer state; errors here mean the batch does not fit."""
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            UnsupportedOperatorException,
        )

        try:
            self.run()
        except torch.OutOfMemoryError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as error:
            raise _cannot_simulate(error) from error
        except RuntimeError as error:
            raise does_not_fit(self.batch, error) from error

    def measure(self, tracker: LiveTensors) -> tuple[int, int, SavedTensors]:
        """The steady-state step: returns (gradient bytes, optimizer-state bytes, saved tensors)."""
        resident = [*self.model.parameters(), *self.model.buffers()]
        exclude = {storage_of(t)._cdata for t in resident if storage_of(t) is not None}
        saved = SavedTensors(self.model, exclude, tracker)
        optimizer = self.step.optimizer
        with tracker:
            grads_before = [p.grad for p in self.model.parameters() if p.grad is not None]  # set_to_none=False
            tracker.add([*resident, *optimizer_tensors(optimizer), *self.batch.tensors(), *grads_before])
            del grads_before
            grads = self.run(tracker, saved)
            owners = {  # what each storage alive now is, by its serial (the sets do not overlap)
                "parameters": {tracker.serial_of(tensor) for tensor in resident},
                "gradients": self.gradient_serials,
                "optimizer state": {tracker.serial_of(tensor) for tensor in optimizer_tensors(optimizer)},
                "saved activations": saved.serials,
            }
        self.at_peak = _parts_at_peak(tracker.at_peak, owners)
        return grads, storage_bytes(optimizer_tensors(optimizer)), saved

    def result(self, tracker, grads, optimizer_state, saved, **fields) -> MemoryBreakdown:
        copy_dtypes = sorted(str(dtype).removeprefix("torch.") for dtype in saved.weight_copy_dtypes)
        return MemoryBreakdown(
            at_peak=self.at_peak,
            saved_weight_copies=saved.weight_copies,
            weight_copy_dtype="/".join(copy_dtypes) or None,
            batch_size=self.batch.size,
            params=storage_bytes(self.model.parameters()),
            buffers=storage_bytes(self.model.buffers()),
            grads=grads,
            optimizer_state=optimizer_state,
            activations=saved.bytes,
            peak_phase=tracker.peak_phase,
            layers=dict(saved.by_module),
            timeline=list(tracker.samples),
            phases=list(tracker.phase_starts),
            **fields,
        )


def _parts_at_peak(alive: dict[int, int], owners: dict[str, set[int]]) -> dict[str, int]:
    """Bytes of each part among the storages alive at the peak (serial -> bytes); the rest is "other"."""
    parts = dict.fromkeys(owners, 0)
    for serial, size in alive.items():
        part = next((name for name, serials in owners.items() if serial in serials), None)
        if part is not None:
            parts[part] += size
    return parts


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


@keeps_generators
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
