"""The training step that gk.memory measures, on real tensors (breakdown) or fake ones (estimate).

check_model() and sample_batch() check what a memory function was given and turn the example batch, of any form
fit accepts (gpukit.step), into a Batch; compact() gives it storage of its own; build_optimizer() builds fit's
optimizer for a copy of the model. MeasuredStep runs gpukit.step's TrainStep, the one fit runs, with a mark at each
phase (forward, backward, optimizer step) and counts each part of its memory: parameters, gradients, optimizer
state, saved activations.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch
from torch import nn

from ..optim import make_optimizer
from ..step import Batch, TrainStep, split_batch, unpack_outputs
from .counting import LiveTensors, SavedTensors, dense_parts, optimizer_tensors, storage_bytes, storage_of
from .parts import MemoryBreakdown


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
