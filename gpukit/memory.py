"""Training memory: measure it, break it down, predict it, and find the batch that fits.

measure()          peak memory of a block of code. On CUDA, the caching allocator's statistics
                   (allocated, reserved, and the cache between them); elsewhere, the bytes of
                   tensor storages alive, tracked operator by operator.
breakdown()        one training step measured: parameters, gradients, optimizer state,
                   activations saved for backward (saved-tensor hooks), the rest, the peak.
estimate()         the same fields predicted with fake tensors: nothing runs on the device.
max_batch_size()   the largest batch under a memory budget; accumulation keeps a global batch.
plot_breakdowns(), plot_timeline(), table()   what the lessons draw and print.

The CUDA allocator tools (out-of-memory help, free_memory, limit_gpu_memory,
expandable_segments, record_snapshot) live in gpukit.allocator and are re-exported here.
Every byte count is of tensor storages, each storage counted once however many views use it.
"""

from __future__ import annotations

import contextlib
import copy
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from .allocator import (  # noqa: F401  (re-exported: gk.memory is the public face of both)
    Snapshot,
    TrainingOutOfMemoryError,
    expandable_segments,
    free_memory,
    limit_gpu_memory,
    out_of_memory_error,
    record_snapshot,
    watch_out_of_memory,
)
from .env import resolve_device
from .precision import PRECISIONS, Precision, get_precision
from .report import Table, format_bytes

CUDA_BLOCK = 512  # bytes: the CUDA caching allocator rounds every allocation up to a multiple of this


# ---------------------------------------------------------------------------------------------
# Counting tensors


def _storage(tensor) -> torch.UntypedStorage | None:
    if not isinstance(tensor, torch.Tensor) or tensor.is_sparse:
        return None
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # tensors without a storage (nested, some subclasses)
        return None


def _storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind `tensors`."""
    sizes = {}
    for tensor in tensors:
        storage = _storage(tensor)
        if storage is not None:
            sizes[storage._cdata] = storage.nbytes()
    return sum(sizes.values())


def _optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [value for state in optimizer.state.values() for value in state.values() if isinstance(value, torch.Tensor)]


class _LiveTensors(TorchDispatchMode):
    """Bytes of tensor storages alive, updated after every operator.

    A new storage is counted when an operator first returns it (views share their base's
    storage) and uncounted when it is freed (a weak reference's callback). Storages that
    existed before are counted only if passed to `add`. `phase` labels the samples.
    """

    def __init__(self, device_type: str, rounding: int = 1):
        super().__init__()
        self.device_type = device_type
        self.rounding = rounding
        self.live: dict[int, tuple[weakref.ref, int]] = {}  # storage id -> (weak reference, bytes)
        self.bytes = 0
        self.peak = 0
        self.peak_phase = "start"
        self.phase = "start"
        self.samples: list[int] = []  # bytes alive after each operator
        self.phase_starts: list[tuple[str, int]] = []  # (phase, index of its first sample)

    def add(self, tensors) -> None:
        for tensor in tensors:
            self._count(tensor)
        self._sample()

    def start_phase(self, name: str) -> None:
        self.phase = name
        self.phase_starts.append((name, len(self.samples)))

    def _count(self, tensor) -> None:
        if not isinstance(tensor, torch.Tensor) or tensor.device.type != self.device_type:
            return
        storage = _storage(tensor)
        if storage is None:
            return
        key = storage._cdata
        size = -(-storage.nbytes() // self.rounding) * self.rounding
        known = self.live.get(key)
        if known is not None:  # in place, or a view; an out= argument may have been resized
            self.bytes += size - known[1]
            self.live[key] = (known[0], size)
            return
        self.bytes += size
        self.live[key] = (weakref.ref(storage, partial(self._freed, key)), size)

    def _freed(self, key: int, _reference) -> None:
        entry = self.live.pop(key, None)
        if entry is not None:
            self.bytes -= entry[1]

    def _sample(self) -> None:
        self.samples.append(self.bytes)
        if self.bytes > self.peak:
            self.peak, self.peak_phase = self.bytes, self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # An output that shares an input's storage (a view, an in-place result) allocated nothing.
        inputs = {storage._cdata for storage in map(_storage, tree_leaves((args, kwargs))) if storage is not None}
        for tensor in tree_leaves(out):
            storage = _storage(tensor)
            if storage is not None and (storage._cdata not in inputs or storage._cdata in self.live):
                self._count(tensor)
        self._sample()
        return out

    def __exit__(self, *exc):
        result = super().__exit__(*exc)
        self.live.clear()  # drops the weak references: no callbacks after the measurement
        return result


class _SavedTensors:
    """Bytes that autograd saves for backward, from saved-tensor hooks, per module.

    Each storage counts once; parameters and buffers (the `exclude` storages) are not
    activations and are left out. Inside a non-reentrant checkpoint region only the region's
    inputs are saved, so a checkpointed model is counted as it really is.
    """

    def __init__(self, model: nn.Module, exclude: set[int]):
        self.model = model
        self.exclude = exclude
        self.seen: set[int] = set()
        self.bytes = 0
        self.by_module: Counter = Counter()
        self.stack: list[str] = []

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = _storage(tensor)
        if storage is not None and storage._cdata not in self.seen and storage._cdata not in self.exclude:
            self.seen.add(storage._cdata)
            self.bytes += storage.nbytes()
            self.by_module[self.stack[-1] if self.stack else "(outside modules)"] += storage.nbytes()
        return tensor

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        def enter(name: str) -> Callable:
            def hook(*_) -> None:  # a hook that returns something would replace the module's input
                self.stack.append(name or "(model)")

            return hook

        def leave(*_) -> None:
            if self.stack:
                self.stack.pop()

        handles = []
        for name, module in self.model.named_modules():
            handles.append(module.register_forward_pre_hook(enter(name)))
            handles.append(module.register_forward_hook(leave, always_call=True))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor):
                yield
        finally:
            for handle in handles:
                handle.remove()


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
    tracker = _LiveTensors(device.type)
    try:
        with tracker:
            yield result
    finally:
        result.peak, result.end = tracker.peak, tracker.bytes


# ---------------------------------------------------------------------------------------------
# Breakdown of one training step


@dataclass
class MemoryBreakdown:
    """Bytes of one training step, measured (`breakdown`) or predicted (`estimate`).

    params, buffers, grads, optimizer_state:  what the model and optimizer keep.
    activations:  bytes saved for backward in the forward pass (autocast's low-precision
                  weight copies included), each storage once.
    total:        the peak during the step; `other` is what the parts above do not explain
                  (temporaries, the input batch, cuDNN/cuBLAS workspaces on a GPU). It is
                  negative when gradients and saved activations never all lived at once.
    allocator_cache: CUDA only: reserved minus allocated at the peak.
    layers:       saved bytes per module (the innermost module running when it was saved).
    timeline:     bytes of tensor storages alive after each operator; `phases` gives the
                  index where each phase (forward, backward, optimizer step) starts.
    """

    batch_size: int
    device: str
    precision: str
    optimizer: str
    params: int
    buffers: int
    grads: int
    optimizer_state: int
    activations: int
    total: int
    source: str
    allocator_cache: int | None = None
    peak_phase: str | None = None
    layers: dict[str, int] = field(default_factory=dict)
    timeline: list[int] = field(default_factory=list, repr=False)
    phases: list[tuple[str, int]] = field(default_factory=list, repr=False)

    @property
    def other(self) -> int:
        return self.total - (self.params + self.buffers + self.grads + self.optimizer_state + self.activations)

    def parts(self) -> dict[str, int]:
        """The stacked categories, in bytes (the allocator cache only where measured)."""
        parts = {
            "parameters": self.params + self.buffers, "gradients": self.grads,
            "optimizer state": self.optimizer_state, "saved activations": self.activations, "other": self.other,
        }  # fmt: skip
        if self.allocator_cache is not None:
            parts["allocator cache"] = self.allocator_cache
        return parts

    def row(self) -> dict:
        """One table row in MiB."""
        mib = 2**20
        row = {"batch": self.batch_size, "precision": self.precision, "optimizer": self.optimizer}
        row |= {f"{name} (MiB)": value / mib for name, value in self.parts().items()}
        return row | {"peak (MiB)": self.total / mib}

    def table(self) -> Table:
        parts = self.parts() | {"peak during the step": self.total}
        rows = [
            {"part": name, "bytes": value, "size": format_bytes(value), "% of peak": 100 * value / max(self.total, 1)}
            for name, value in parts.items()
        ]
        return Table(
            rows,
            title=f"one training step, batch {self.batch_size}, {self.precision}, {self.optimizer} ({self.source})",
        )

    def largest_layers(self, count: int = 5) -> Table:
        rows = [{"module": name, "saved (MiB)": size / 2**20, "% of activations": 100 * size / max(self.activations, 1)}
                for name, size in Counter(self.layers).most_common(count)]  # fmt: skip
        return Table(rows, title=f"the {count} modules that save the most for backward")

    def plot(self, **kwargs):
        return plot_breakdowns({f"batch {self.batch_size}": self}, **kwargs)


def _model_checked(model: nn.Module) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    if not any(True for _ in model.parameters()):
        raise ValueError(
            "the model has no parameters, so training it uses no memory for weights, gradients or optimizer "
            "state; pass the model you mean to train."
        )


def _input_checked(sample_input) -> torch.Tensor:
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(
            f"sample_input must be a tensor batch such as (batch, 3, 32, 32), got {type(sample_input).__name__}."
        )
    if sample_input.dim() == 0 or sample_input.shape[0] == 0:
        raise ValueError(
            f"sample_input must be a batch with at least one example, got shape {tuple(sample_input.shape)}."
        )
    return sample_input


def _default_labels(labels, batch_size: int, device) -> torch.Tensor:
    if labels is None:  # class 0 for every example: the values do not change memory
        return torch.zeros(batch_size, dtype=torch.long, device=device)
    return labels.to(device)


def _does_not_fit(images: torch.Tensor, error: Exception) -> ValueError:
    first_line = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return ValueError(
        f"the input of shape {tuple(images.shape)} does not fit the model ({first_line}). Pass a batch shaped "
        "like the model's training data, e.g. (batch, 3, 32, 32) for the kit's CNNs."
    )


def _cannot_simulate(error: Exception) -> ValueError:
    return ValueError(
        f"the model runs an operation that fake tensors cannot simulate ({type(error).__name__}: "
        f"{str(error).strip().splitlines()[0] if str(error).strip() else ''}), usually one whose result depends on "
        "tensor values; measure it with gk.memory.breakdown() on a small batch instead."
    )


def _optimizer(optimizer, model: nn.Module, foreach: bool | None) -> tuple[torch.optim.Optimizer, str]:
    from .train import make_optimizer  # fit's optimizers, so that the memory matches fit's

    if isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            "pass the optimizer as a name ('sgd', 'adamw') or a function of the parameters: an Optimizer "
            "object is tied to one model's parameters, and memory is measured on a copy."
        )
    built = make_optimizer(optimizer, model.parameters(), lr=1e-3, weight_decay=5e-4)
    if foreach is not None:  # CUDA optimizers default to foreach kernels, whose temporaries count
        for group in built.param_groups:
            group["foreach"] = foreach
    return built, optimizer if isinstance(optimizer, str) else type(built).__name__


@dataclass
class _Step:
    """One training step as fit() runs it, with hooks to measure it on real or fake tensors."""

    model: nn.Module
    images: torch.Tensor
    labels: torch.Tensor
    optimizer: torch.optim.Optimizer
    autocast: Callable[[], contextlib.AbstractContextManager]
    backward: Callable[[torch.Tensor], None]
    step: Callable[[torch.optim.Optimizer], None]
    loss_fn: Callable
    set_to_none: bool

    def run(self, tracker: _LiveTensors | None = None, saved: _SavedTensors | None = None) -> int:
        """Forward, backward, optimizer step, zero_grad; returns the gradients' bytes."""
        mark = tracker.start_phase if tracker is not None else lambda name: None
        mark("forward")
        with saved.counting() if saved is not None else contextlib.nullcontext(), self.autocast():
            loss = self.loss_fn(self.model(self.images).float(), self.labels)
        mark("backward")
        self.backward(loss)
        del loss  # frees the graph's last references before the optimizer step, as in fit
        grads = _storage_bytes(p.grad for p in self.model.parameters() if p.grad is not None)
        mark("optimizer step")
        self.step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=self.set_to_none)
        return grads

    def warm_up(self) -> None:
        """The first step creates the optimizer state; errors here mean the input does not fit."""
        from torch._subclasses.fake_tensor import (
            DataDependentOutputException,
            DynamicOutputShapeException,
            UnsupportedOperatorException,
        )  # fmt: skip

        try:
            self.run()
        except torch.OutOfMemoryError:
            raise
        except (DataDependentOutputException, DynamicOutputShapeException, UnsupportedOperatorException) as error:
            raise _cannot_simulate(error) from error
        except RuntimeError as error:
            raise _does_not_fit(self.images, error) from error

    def measure(self, tracker: _LiveTensors) -> tuple[int, int, _SavedTensors]:
        """The steady-state step: returns (gradient bytes, optimizer-state bytes, saved tensors)."""
        resident = [*self.model.parameters(), *self.model.buffers()]
        saved = _SavedTensors(self.model, {_storage(t)._cdata for t in resident if _storage(t) is not None})
        with tracker:
            grads_before = [p.grad for p in self.model.parameters() if p.grad is not None]  # set_to_none=False
            tracker.add([*resident, *_optimizer_tensors(self.optimizer), self.images, self.labels, *grads_before])
            del grads_before
            grads = self.run(tracker, saved)
        return grads, _storage_bytes(_optimizer_tensors(self.optimizer)), saved

    def result(self, tracker, grads, optimizer_state, saved, **fields) -> MemoryBreakdown:
        return MemoryBreakdown(
            batch_size=len(self.images), params=_storage_bytes(self.model.parameters()),
            buffers=_storage_bytes(self.model.buffers()), grads=grads, optimizer_state=optimizer_state,
            activations=saved.bytes, peak_phase=tracker.peak_phase, layers=dict(saved.by_module),
            timeline=list(tracker.samples), phases=list(tracker.phase_starts), **fields,
        )  # fmt: skip


def breakdown(
    model: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    optimizer: str | Callable = "sgd",
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    loss_fn: Callable = nn.functional.cross_entropy,
    set_to_none: bool = True,
) -> MemoryBreakdown:
    """Measure where the memory of one training step goes.

    Trains a copy of `model` (yours is not changed) for two steps on `device`, as fit() does,
    and measures the second, which starts from the steady state (optimizer state present).
    Parameters, gradients, optimizer state and saved activations are counted from the tensors
    themselves; the peak comes from the CUDA allocator on a GPU, and from tensor storages
    tracked per operator elsewhere. `labels` default to class 0 (values do not change memory).
    `set_to_none=False` keeps zeroed gradients between steps, as zero_grad(set_to_none=False).
    """
    _model_checked(model)
    images = _input_checked(images)
    device = resolve_device(device)
    precision = get_precision(precision, device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        baseline = torch.cuda.memory_allocated(device)  # what this step does not own
    copied = copy.deepcopy(model).to(device).train()
    built, optimizer_name = _optimizer(optimizer, copied, foreach=None)
    step = _Step(
        copied, images.to(device), _default_labels(labels, len(images), device), built, precision.autocast,
        precision.backward, lambda optimizer: precision.step(optimizer, copied.parameters()), loss_fn, set_to_none,
    )  # fmt: skip
    tracker = _LiveTensors(device.type)
    with precision.flags():
        step.warm_up()
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        grads, optimizer_state, saved = step.measure(tracker)
    fields = {"total": tracker.peak, "source": f"measured on {device.type.upper()}: {_TRACKED}"}
    if cuda:
        torch.cuda.synchronize(device)
        peak_allocated = torch.cuda.max_memory_allocated(device)
        fields = {
            "total": peak_allocated - baseline, "source": "measured on CUDA: torch.cuda.max_memory_allocated",
            "allocator_cache": torch.cuda.max_memory_reserved(device) - peak_allocated,
        }  # fmt: skip
    return step.result(tracker, grads, optimizer_state, saved, device=device.type, precision=precision.name,
                       optimizer=optimizer_name, **fields)  # fmt: skip


# ---------------------------------------------------------------------------------------------
# Predict with fake tensors


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


def _target(device: str | torch.device | None) -> torch.device:
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


def _precision_name(precision: str | Precision) -> str:
    name = precision.name if isinstance(precision, Precision) else precision
    if name not in PRECISIONS:
        raise ValueError(f"precision={name!r} is unknown; use one of {', '.join(map(repr, PRECISIONS))}.")
    return name


def _predict(model, sample_input, labels, batch_size, *, optimizer, precision, target, loss_fn, set_to_none):
    simulated = target if target.type != "cuda" or torch.cuda.is_available() else torch.device("cpu")
    dtype = Precision(precision, torch.device("cpu")).dtype  # the autocast dtype (None: no autocast)
    from torch._subclasses.fake_tensor import FakeTensorMode

    modes = [(module, module.training) for module in model.modules()]
    try:
        with FakeTensorMode(), _fake_parameters(model, simulated):
            model.train()
            images = torch.empty((batch_size, *sample_input.shape[1:]), dtype=sample_input.dtype, device=simulated)
            if sample_input.dim() == 4 and sample_input.is_contiguous(memory_format=torch.channels_last):
                images = images.contiguous(memory_format=torch.channels_last)
            fake_labels = (
                torch.zeros(batch_size, dtype=torch.long, device=simulated) if labels is None
                else torch.zeros((batch_size, *labels.shape[1:]), dtype=labels.dtype, device=simulated)
            )  # fmt: skip
            built, optimizer_name = _optimizer(optimizer, model, foreach=True if target.type == "cuda" else None)
            step = _Step(
                model, images, fake_labels, built,
                lambda: torch.autocast(simulated.type, dtype=dtype or torch.float32, enabled=dtype is not None),
                lambda loss: loss.backward(), lambda optimizer: optimizer.step(), loss_fn, set_to_none,
            )  # fmt: skip
            # No loss scaler here: fp16's scaler needs real values, and its memory is a few scalars.
            step.warm_up()
            tracker = _LiveTensors(simulated.type, CUDA_BLOCK if target.type == "cuda" else 1)
            grads, optimizer_state, saved = step.measure(tracker)
            source = f"predicted with fake tensors on {simulated.type.upper()}"
            if target.type == "cuda":
                source += " for CUDA (blocks of 512 bytes; cuDNN/cuBLAS workspaces not included)"
            return step.result(tracker, grads, optimizer_state, saved, total=tracker.peak, source=source,
                               device=target.type, precision=precision, optimizer=optimizer_name)  # fmt: skip
    finally:
        for module, training in modes:
            module.training = training


def estimate(
    model: nn.Module,
    sample_input: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    optimizer: str | Callable = "sgd",
    precision: str | Precision = "fp32",
    batch_sizes: Sequence[int] | None = None,
    device: str | torch.device | None = None,
    loss_fn: Callable = nn.functional.cross_entropy,
    set_to_none: bool = True,
) -> MemoryBreakdown | list[MemoryBreakdown]:
    """Predict the memory of one training step without running it on the device.

    The step (forward, backward, optimizer step, twice, as in breakdown) runs on fake tensors
    (torch's FakeTensorMode), which carry shapes and dtypes but no data; the same counters as
    breakdown() then give the same fields, and the peak is the most bytes alive at once.
    `device="cuda"` predicts for a GPU even on a machine without one (simulated on the CPU's
    operators, with CUDA's 512-byte allocation blocks). With `batch_sizes`, returns one
    prediction per batch size (only the batch dimension of `sample_input` changes), else
    one for the batch size of `sample_input`. Your model is not changed.
    """
    _model_checked(model)
    sample_input = _input_checked(sample_input)
    target = _target(device)
    precision = _precision_name(precision)
    sizes = [len(sample_input)] if batch_sizes is None else list(batch_sizes)
    if not sizes or any(not isinstance(size, int) or size < 1 for size in sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}.")
    predictions = [
        _predict(model, sample_input, labels, size, optimizer=optimizer, precision=precision, target=target,
                 loss_fn=loss_fn, set_to_none=set_to_none)
        for size in sizes
    ]  # fmt: skip
    return predictions[0] if batch_sizes is None else predictions


# ---------------------------------------------------------------------------------------------
# The largest batch that fits


@dataclass
class BatchSizePlan:
    """The largest micro-batch under a memory budget, and how to keep a global batch.

    `usable` is the budget less the safety margin; `predicted_peak` is the prediction at
    `batch_size`; `probes` are real steps on the GPU (batch_size, peak bytes or None for an
    out-of-memory error). To train with a global batch G: fit(batch_size=micro_batch_size,
    accumulate=accumulate), where micro_batch_size · accumulate = G.
    """

    batch_size: int
    budget: int
    margin: float
    predicted_peak: int
    micro_batch_size: int
    accumulate: int = 1
    global_batch_size: int | None = None
    probes: list[dict] = field(default_factory=list)
    source: str = ""

    @property
    def usable(self) -> int:
        return int(self.budget * (1 - self.margin))

    def __str__(self) -> str:
        text = (
            f"largest batch {self.batch_size}: predicted peak {format_bytes(self.predicted_peak)} of "
            f"{format_bytes(self.usable)} usable ({format_bytes(self.budget)} budget less a {self.margin:.0%} margin)"
        )
        if self.global_batch_size is not None:
            text += f"; global batch {self.global_batch_size} = {self.accumulate} × {self.micro_batch_size} (accumulate={self.accumulate})"
        if self.probes:
            text += "; checked on the GPU: " + ", ".join(
                f"{p['batch_size']} → {format_bytes(p['peak']) if p['peak'] is not None else 'out of memory'}"
                for p in self.probes
            )
        return text


def _free_for_training(device: torch.device) -> int:
    """Free device memory plus what PyTorch caches but does not use (it can reuse that)."""
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def max_batch_size(
    model: nn.Module,
    sample_input: torch.Tensor,
    labels: torch.Tensor | None = None,
    *,
    budget: int | None = None,
    margin: float = 0.1,
    global_batch_size: int | None = None,
    optimizer: str | Callable = "sgd",
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    loss_fn: Callable = nn.functional.cross_entropy,
    set_to_none: bool = True,
    probe: bool = True,
    largest: int = 2**20,
) -> BatchSizePlan:
    """The largest batch whose training step fits `budget` bytes, less a safety `margin`.

    `budget` defaults to the free memory of the CUDA GPU; give it in bytes to plan for a GPU
    you do not have (e.g. 16 * 2**30 with device="cuda"). The search uses predictions
    (estimate: peak memory grows linearly with the batch, checked at the answer), then, on a
    CUDA GPU with `probe`, a few real steps that lower the answer if the GPU disagrees. With
    `global_batch_size`, the plan keeps it by gradient accumulation when it does not fit whole.
    The search stops at `largest` examples.
    """
    _model_checked(model)
    sample_input = _input_checked(sample_input)
    target = _target(device)
    precision = _precision_name(precision)
    on_gpu = target.type == "cuda" and torch.cuda.is_available()
    if budget is None:
        if not on_gpu:
            raise ValueError(
                "there is no CUDA GPU here to read free memory from; pass budget in bytes, e.g. "
                "budget=16 * 2**30 with device='cuda' to plan for a 16 GiB GPU."
            )
        budget = _free_for_training(target)
    if not isinstance(budget, (int, float)) or budget <= 0:
        raise ValueError(f"budget must be a positive number of bytes, got {budget!r}; e.g. 16 * 2**30 for 16 GiB.")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}; 0.1 keeps 10% of the budget free.")
    if global_batch_size is not None and (not isinstance(global_batch_size, int) or global_batch_size < 1):
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size!r}.")
    usable = int(budget * (1 - margin))
    predicted: dict[int, MemoryBreakdown] = {}

    def predict(size: int) -> MemoryBreakdown:
        if size not in predicted:
            predicted[size] = _predict(model, sample_input, labels, size, optimizer=optimizer, precision=precision,
                                       target=target, loss_fn=loss_fn, set_to_none=set_to_none)  # fmt: skip
        return predicted[size]

    def peak(size: int) -> int:
        return predict(size).total

    # A first guess from a line: saved activations grow exactly linearly with the batch (the peak
    # may not, at small batches, when it comes in the optimizer step); then check around it.
    per_example = max((predict(32).activations - predict(16).activations) / 16, 1.0)
    fixed = peak(16) - 16 * per_example
    guess = min(max(int((usable - fixed) / per_example), 1), largest)
    # Bracket the answer around the guess (low fits, high does not), galloping outwards, then bisect.
    if peak(guess) <= usable:
        low, stride = guess, 1
        while low + stride <= largest and peak(low + stride) <= usable:
            low, stride = low + stride, 2 * stride
        high = min(low + stride, largest + 1)
    else:
        high, stride = guess, 1
        while high - stride >= 1 and peak(high - stride) > usable:
            high, stride = high - stride, 2 * stride
        low = max(high - stride, 0)
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if peak(middle) <= usable else (low, middle)
    if low == 0:
        raise ValueError(
            f"not even a batch of 1 fits {format_bytes(usable)}: one step needs {format_bytes(peak(1))}, most of it "
            "parameters, gradients and optimizer state. Use optimizer='sgd', a smaller model, or a larger budget."
        )
    plan = BatchSizePlan(low, int(budget), margin, peak(low), low, source=f"predicted for {target.type}")
    if low == largest:
        plan.source += f" (the search stopped at largest={largest}: more may fit)"
    if on_gpu and probe:
        _probe(plan, model, sample_input, labels, optimizer=optimizer, precision=precision, device=target,
               loss_fn=loss_fn, set_to_none=set_to_none)  # fmt: skip
        plan.predicted_peak = peak(plan.batch_size)
    if global_batch_size is not None:
        plan.global_batch_size = global_batch_size
        plan.accumulate = next(
            k
            for k in range(1, global_batch_size + 1)
            if global_batch_size % k == 0 and global_batch_size // k <= plan.batch_size
        )
        plan.micro_batch_size = global_batch_size // plan.accumulate
    return plan


def _probe(
    plan: BatchSizePlan,
    model,
    sample_input,
    labels,
    *,
    optimizer,
    precision,
    device,
    loss_fn,
    set_to_none,
    tries: int = 3,
) -> None:
    """Real steps on the GPU at the planned batch; lower it while the GPU disagrees with the plan."""
    size = plan.batch_size
    for _ in range(tries):
        index = torch.arange(size) % len(sample_input)  # repeat the sample: values do not change memory
        batch_labels = None if labels is None else labels[index % len(labels)]
        try:
            measured = breakdown(model, sample_input[index], batch_labels, optimizer=optimizer, precision=precision,
                                 device=device, loss_fn=loss_fn, set_to_none=set_to_none).total  # fmt: skip
        except torch.OutOfMemoryError:
            measured = None
        free_memory(device)
        plan.probes.append({"batch_size": size, "peak": measured})
        if measured is not None and measured <= plan.usable:
            plan.batch_size = plan.micro_batch_size = size
            plan.source += ", checked on the GPU"
            return
        shrink = plan.usable / measured if measured else 0.8
        size = max(min(int(size * shrink), size - 1), 1)
    plan.batch_size = plan.micro_batch_size = size
    plan.source += f", lowered after {tries} probes on the GPU (this size is not confirmed)"


# ---------------------------------------------------------------------------------------------
# Tables and plots


def table(breakdowns: dict[str, MemoryBreakdown] | Sequence[MemoryBreakdown], title: str | None = None) -> Table:
    """One row per breakdown or prediction, sizes in MiB."""
    items = breakdowns.items() if isinstance(breakdowns, dict) else ((None, b) for b in breakdowns)
    rows = [({"case": name} if name is not None else {}) | b.row() for name, b in items]
    return Table(rows, title=title)


_COLOURS = {
    "parameters": "#4c72b0", "gradients": "#dd8452", "optimizer state": "#55a868",
    "saved activations": "#c44e52", "other": "#8c8c8c", "allocator cache": "#d9d9d9",
}  # fmt: skip


def plot_breakdowns(breakdowns: dict[str, MemoryBreakdown], title: str = "where training memory goes"):
    """Stacked bars, one per breakdown; a black line marks each step's peak.

    A negative "other" (gradients and activations never all alive at once) is not drawn: the
    peak line then lies below the top of the stack.
    """
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(max(4.5, 1.3 * len(breakdowns) + 2.5), 4))
    for position, parts in enumerate(breakdowns.values()):
        bottom = 0.0
        for part, value in parts.parts().items():
            if value > 0:
                axis.bar(position, value / 2**20, bottom=bottom, color=_COLOURS[part], label=part)
                bottom += value / 2**20
        axis.hlines(
            parts.total / 2**20,
            position - 0.45,
            position + 0.45,
            colors="black",
            label="peak",
        )
    handles, labels = axis.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    axis.legend(unique.values(), unique.keys(), fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1))
    axis.set_xticks(range(len(breakdowns)), list(breakdowns), rotation=15)
    axis.set(ylabel="MiB", title=title)
    figure.tight_layout()
    return figure


def plot_timeline(source: MemoryBreakdown | Snapshot | Sequence[int], title: str | None = None):
    """Memory after each operator (a breakdown or estimate) or allocator event (a Snapshot)."""
    import matplotlib.pyplot as plt

    phases = []
    if isinstance(source, MemoryBreakdown):
        values, phases = source.timeline, source.phases
        xlabel, default = "operator (in the order they ran)", f"one training step: {source.source}"
    elif isinstance(source, Snapshot):
        values, xlabel, default = source.timeline(), "allocation or free", "one training step: CUDA memory snapshot"
    else:
        values, xlabel, default = list(source), "event", "memory over time"
    figure, axis = plt.subplots(figsize=(8, 3.5))
    axis.plot([v / 2**20 for v in values], color="black", linewidth=1)
    ends = [start for _, start in phases[1:]] + [len(values)]
    for (name, start), end, colour in zip(phases, ends, ("#dbe9f6", "#fbe3d6", "#dff0d8")):
        axis.axvspan(start, max(end - 1, start), color=colour, label=name)
    if values:
        peak = max(range(len(values)), key=values.__getitem__)
        axis.plot(peak, values[peak] / 2**20, "v", color="#c44e52", label=f"peak {format_bytes(values[peak])}")
    axis.set(xlabel=xlabel, ylabel="MiB alive", title=title or default)
    axis.legend(fontsize=8, loc="upper right")
    figure.tight_layout()
    return figure
