"""The largest batch that fits a memory budget, and how to keep a global batch by accumulation."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..precision import Precision
from ..report import format_bytes
from ..step import Batch
from ..validation import check_int
from .allocator import free_memory
from .counting import keeps_generators
from .measured_step import check_model, sample_batch
from .measuring import breakdown
from .parts import MemoryBreakdown
from .prediction import precision_name, predict, target_device


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


@keeps_generators
def max_batch_size(
    model: nn.Module,
    batch,
    labels: torch.Tensor | None = None,
    *,
    budget: int | None = None,
    margin: float = 0.1,
    global_batch_size: int | None = None,
    optimizer: str | Callable = "nesterov",
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    loss_fn: str | Callable | None = None,
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
    check_model(model)
    batch = sample_batch(model, batch, labels)
    target = target_device(device)
    precision = precision_name(precision)
    on_gpu = target.type == "cuda" and torch.cuda.is_available()
    budget = _check_budget(budget, margin, global_batch_size, target, on_gpu)
    options = dict(optimizer=optimizer, precision=precision, loss_fn=loss_fn, set_to_none=set_to_none)

    @functools.cache
    def prediction(size: int) -> MemoryBreakdown:
        return predict(model, batch, size, target=target, **options)

    usable = int(budget * (1 - margin))
    low = _largest_that_fits(prediction, usable, largest)
    plan = BatchSizePlan(low, int(budget), margin, prediction(low).total, low, source=f"predicted for {target.type}")
    if low == largest:
        plan.source += f" (the search stopped at largest={largest}: more may fit)"
    if on_gpu and probe:
        _probe(plan, model, batch, device=target, **options)
        plan.predicted_peak = prediction(plan.batch_size).total
    if global_batch_size is not None:  # the fewest micro-batches of equal size that fit
        plan.global_batch_size = global_batch_size
        plan.accumulate = next(
            k
            for k in range(1, global_batch_size + 1)
            if global_batch_size % k == 0 and global_batch_size // k <= plan.batch_size
        )
        plan.micro_batch_size = global_batch_size // plan.accumulate
    return plan


def _check_budget(budget, margin, global_batch_size, target: torch.device, on_gpu: bool) -> int | float:
    """The budget in bytes (default: what the GPU has free for training), refused before any work if wrong."""
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
    if global_batch_size is not None:
        check_int("global_batch_size", global_batch_size)
    return budget


def _largest_that_fits(prediction, usable: int, largest: int) -> int:
    """The largest batch size whose `prediction(size).total` is at most `usable` bytes (searching up to `largest`)."""

    def peak(size: int) -> int:
        return prediction(size).total

    # A first guess from a line: saved activations grow exactly linearly with the batch (the peak
    # may not, at small batches, when it comes in the optimizer step); then check around it.
    per_example = max((prediction(32).activations - prediction(16).activations) / 16, 1.0)
    fixed = peak(16) - 16 * per_example
    guess = min(max(int((usable - fixed) / per_example), 1), largest)
    # The peak is a line in the batch size at large sizes: one secant step through the guess's own
    # peak lands within a few examples of the answer, so the search below takes few predictions.
    if guess > 32 and peak(guess) != peak(32):
        slope = (peak(guess) - peak(32)) / (guess - 32)
        guess = min(max(32 + int((usable - peak(32)) / slope), 1), largest)
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
            "parameters, gradients and optimizer state. Use optimizer='nesterov', a smaller model, or a larger budget."
        )
    return low


def _probe(
    plan: BatchSizePlan,
    model,
    batch: Batch,
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
        try:
            measured = breakdown(
                model,
                repeated(batch, size),
                optimizer=optimizer,
                precision=precision,
                device=device,
                loss_fn=loss_fn,
                set_to_none=set_to_none,
            ).total
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


def repeated(batch: Batch, batch_size: int) -> Batch:
    """The sample's examples repeated to `batch_size` (values do not change memory)."""
    index = torch.arange(batch_size) % batch.size
    new = batch.map(lambda t: t[index.to(t.device)] if t.dim() and t.shape[0] == batch.size else t)
    return Batch(new.args, new.kwargs, new.target, batch_size)
