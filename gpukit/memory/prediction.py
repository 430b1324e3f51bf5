"""Predict the memory of one training step with fake tensors: nothing runs on the device."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence

import torch
from torch import nn

from ..env import resolve_device
from ..optim import OPTIMIZERS, muon_parameters
from ..precision import PRECISIONS, Precision
from ..sparse_gradients import sparse_tables
from ..step import Batch, Loss, TrainStep, training_mode
from ..validation import is_int
from .counting import CUDA_BLOCK, LiveTensors, keeps_generators
from .fused_workspaces import FusedWorkspaces
from .measured_step import CannotSimulateError, MeasuredStep, build_optimizer, check_model, sample_batch
from .measuring import measured_instead
from .parts import MemoryBreakdown


@contextlib.contextmanager
def _fake_parameters(model: nn.Module, device: torch.device) -> Iterator[None]:
    """Put fake tensors on `device` in place of the model's parameters and buffers, then restore.

    Must run inside a FakeTensorMode, which makes `torch.empty_strided` return fake tensors:
    they have shapes, dtypes and storages, but no data, so nothing is allocated.
    """
    swapped, fakes = [], {}
    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in list(table.items()):
                    if tensor is None:
                        continue
                    if id(tensor) not in fakes:  # tied weights stay tied
                        fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
                        if isinstance(tensor, nn.Parameter):
                            fake = nn.Parameter(fake, requires_grad=tensor.requires_grad)
                        fakes[id(tensor)] = fake
                    swapped.append((table, name, tensor))
                    table[name] = fakes[id(tensor)]
        yield
    finally:
        for table, name, tensor in reversed(swapped):
            table[name] = tensor


def target_device(device: str | torch.device | None) -> torch.device:
    """The device a prediction is for; "cuda" is allowed on a machine without a GPU."""
    if device is None:
        return resolve_device(None)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{device!r} is not a device; use 'cpu' or 'cuda'.") from error
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"memory can be predicted for 'cpu' or 'cuda', not {device.type!r}.")
    return device


def precision_name(precision: str | Precision) -> str:
    name = precision.name if isinstance(precision, Precision) else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}.")
    return name


def resized(batch: Batch, batch_size: int, device: torch.device) -> Batch:
    """Zeros shaped like `batch` with `batch_size` examples: every tensor whose first dimension is
    the batch's gets the new size. Inside a FakeTensorMode they are fake (no data)."""

    def resize(tensor: torch.Tensor) -> torch.Tensor:
        shape = (batch_size, *tensor.shape[1:]) if tensor.dim() and tensor.shape[0] == batch.size else tensor.shape
        new = torch.zeros(shape, dtype=tensor.dtype, device=device)
        if new.dim() == 4 and tensor.is_contiguous(memory_format=torch.channels_last):
            new = new.contiguous(memory_format=torch.channels_last)
        return new

    new = batch.map(resize)
    return Batch(new.args, new.kwargs, new.target, batch_size)


def predict(
    model, batch: Batch, batch_size: int, *, optimizer, precision: str, target: torch.device, loss_fn, set_to_none: bool
) -> MemoryBreakdown:
    """One prediction: the measured step of breakdown(), run on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    simulated = target if target.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    # No loss scaler: fp16's scaler needs real values, and its memory is a few scalars.
    fake_precision = Precision(precision, simulated, loss_scaling=False)
    # The workspaces are oneDNN's, the CPU's: a cuDNN reserve is not predicted (see the source string).
    workspaces = FusedWorkspaces() if target.type == "cpu" else contextlib.nullcontext()
    with FakeTensorMode(), workspaces, _fake_parameters(model, simulated), training_mode(model):
        built, optimizer_name = build_optimizer(optimizer, model, foreach=True if target.type == "cuda" else None)
        if sparse_tables(model):  # (the optimizer is checked first: one that cannot apply them is refused above)
            raise CannotSimulateError(
                "an nn.Embedding(sparse=True)'s gradient holds one row per id looked up, which fake tensors cannot "
                "count (they give it none)"
            )
        step = TrainStep(model, built, fake_precision, Loss(loss_fn, check_targets=False), set_to_none=set_to_none)
        measured = MeasuredStep(model, resized(batch, batch_size, simulated), step)
        measured.warm_up()
        tracker = LiveTensors(simulated.type, CUDA_BLOCK if target.type == "cuda" else 1)
        grads, optimizer_state, saved = measured.measure(tracker)
        source = f"predicted with fake tensors on {simulated.type.upper()}"
        if target.type == "cpu":  # oneDNN's convolution backward took 4 weights' bytes per thread at 1×1 and 2×2 inputs
            source += "; scratch memory held only inside an operator not included"
        if target.type == "cuda":
            source += " for CUDA (blocks of 512 bytes; cuDNN/cuBLAS workspaces and cuDNN RNN reserves not included)"
        return measured.result(
            tracker,
            grads,
            optimizer_state,
            saved,
            total=tracker.peak,
            source=source,
            device=target.type,
            precision=precision,
            optimizer=optimizer_name,
        )


@keeps_generators
def estimate(
    model: nn.Module,
    batch,
    labels: torch.Tensor | None = None,
    *,
    optimizer: str | Callable = "nesterov",
    precision: str | Precision = "fp32",
    batch_sizes: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    loss_fn: str | Callable | None = None,
    set_to_none: bool = True,
) -> MemoryBreakdown | list[MemoryBreakdown]:
    """Predict the memory of one training step without running it on the device.

    `batch` is an example batch of any form fit accepts, or a tensor of inputs with `labels`
    (as in breakdown). The step (forward, backward, optimizer step, twice, as in breakdown) runs
    on fake tensors (torch's FakeTensorMode), which carry shapes and dtypes but no data; the same
    counters as breakdown() then give the same fields, and the peak is the most bytes alive at
    once. `device="cuda"` predicts for a GPU even on a machine without one (simulated on the
    CPU's operators, with CUDA's 512-byte allocation blocks). With `batch_sizes`, returns one
    prediction per batch size (only the batch dimension of the sample changes), else one for
    the sample's batch size. Your model is not changed.

    Where fake tensors cannot run the model (an operation whose result depends on values: a detector's
    non-maximum suppression; and any detection batch, whose boxes are values), one real step per batch
    size is measured instead, as breakdown() measures it, with a warning; each result's `source` says so.
    """
    check_model(model)
    batch = sample_batch(model, batch, labels)
    target = target_device(device)
    precision = precision_name(precision)
    sizes = [batch.size] if batch_sizes is None else list(batch_sizes)
    if not sizes or not all(is_int(size) and size >= 1 for size in sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}.")
    options = {"optimizer": optimizer, "precision": precision, "loss_fn": loss_fn, "set_to_none": set_to_none}
    try:
        if batch.target_to_model:  # a detection batch: zeros for boxes are no boxes, resized lists no examples
            raise CannotSimulateError(
                "fake tensors carry no values, and a detection batch's boxes and its model's data-dependent "
                "operations (proposal sampling, non-maximum suppression) need real ones"
            )
        predictions = [predict(model, batch, size, target=target, **options) for size in sizes]
    except CannotSimulateError as error:  # measured on a real step instead, saying so
        predictions = measured_instead(model, batch, sizes, error.reason, device=target, **options)
    return predictions[0] if batch_sizes is None else predictions


# Optimizer state per name: (copies of each parameter it keeps, bytes per parameter tensor). The
# copies have the parameter's dtype; the per-tensor bytes are a float32 step counter. From each
# optimizer's documented algorithm: momentum keeps one buffer (SGD, LARS, Muon), RMSprop and
# Adagrad one running sum of squared gradients, Adam, AdamW and LAMB two moments. timm's LAMB
# counts steps per group, not per tensor.
OPTIMIZER_STATE = {
    "sgd": (1, 0),
    "momentum": (1, 0),
    "nesterov": (1, 0),
    "lars": (1, 0),
    "adam": (2, 4),
    "adamw": (2, 4),
    "lamb": (2, 0),
    "rmsprop": (1, 4),
    "adagrad": (1, 4),
}


def optimizer_state_bytes(model: nn.Module, optimizer: str = "adamw") -> int:
    """Bytes of optimizer state that `make_optimizer(optimizer, model, ...)` keeps after its first
    step, predicted from the parameters' sizes: e.g. AdamW 2 × the parameters' bytes (+ 4 bytes of
    step count per tensor), SGD with momentum 1 ×. "muon": 1 × for the hidden weights Muon takes,
    AdamW's for the rest. Counts each parameter once (tied weights) and only those with
    requires_grad. In a job sharded with ZeRO or FSDP2 each rank keeps about this ÷ world size.
    """

    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is unknown; use one of {', '.join(map(repr, OPTIMIZERS))}.")
    check_model(model)
    if optimizer == "muon":
        hidden, rest = muon_parameters(model)
        copies, per_tensor = OPTIMIZER_STATE["adamw"]
        return sum(p.nbytes for p in hidden) + sum(copies * p.nbytes + per_tensor for p in rest)
    copies, per_tensor = OPTIMIZER_STATE[optimizer]
    parameters = {id(p): p for p in model.parameters() if p.requires_grad}.values()
    return sum(copies * p.nbytes + per_tensor for p in parameters)
