"""`lr_find`: the learning-rate range test (Leslie Smith 2015; fastai's and Lightning's lr finder).

Train for a short run while the learning rate grows exponentially from `start_lr` to `end_lr`,
record the loss at each step, smooth it, and stop once it diverges. Where the smoothed loss
falls fastest the model learns; where it turns up the learning rate is too large. The model
and the optimizer are restored to what they were before, bit for bit.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..env import resolve_device
from ..optim import check_lr, make_optimizer
from ..plots import plot_lr_find
from ..precision import Precision, get_precision
from ..step import Loss, TrainStep, training_mode
from ..validation import check_int
from .data import as_loader, batch_on_device, length

SUGGESTION_RULE = "the lr at the minimum of the smoothed loss ÷ 10"


@dataclass
class LRFinderResult:
    """What the range test measured. `suggestion` follows `rule`; `steepest` is the lr where the
    smoothed loss fell fastest (per decade of lr), another common choice, given for comparison."""

    lrs: list[float]
    losses: list[float]  # the loss of each step, as measured
    smoothed: list[float]  # exponential moving average of `losses`, bias-corrected
    suggestion: float
    steepest: float
    rule: str = SUGGESTION_RULE
    stopped: str = ""  # why the run ended: "diverged at lr …" or "reached end_lr"
    extra: dict = field(default_factory=dict)

    @property
    def best_lr(self) -> float:
        """The lr at the minimum of the smoothed loss (the first tenth of the steps left out)."""
        return self.suggestion * 10

    def plot(self, title: str = ""):

        return plot_lr_find(self, title=title)

    def __repr__(self) -> str:
        return (
            f"LRFinderResult(suggestion={self.suggestion:.3g} ({self.rule}), steepest={self.steepest:.3g}, "
            f"steps={len(self.lrs)}, {self.stopped})"
        )


def _check(start_lr, end_lr, steps, smoothing, diverge) -> None:
    check_lr(start_lr)
    check_lr(end_lr)
    if end_lr <= start_lr:
        raise ValueError(f"end_lr ({end_lr:g}) must be above start_lr ({start_lr:g}): the test sweeps upwards.")
    check_int("steps", steps, minimum=5, note="(optimizer steps of the sweep)")
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must lie in [0, 1) (0: no smoothing), got {smoothing!r}.")
    if not diverge > 1:
        raise ValueError(f"diverge must be > 1 (stop when the loss exceeds diverge × its minimum), got {diverge!r}.")


def lr_find(
    model: nn.Module,
    data,
    *,
    optimizer: str | torch.optim.Optimizer | Callable = "nesterov",
    start_lr: float = 1e-5,
    end_lr: float = 10.0,
    steps: int = 100,
    batch_size: int | None = None,
    weight_decay: float = 5e-4,
    precision: str | Precision = "fp32",
    accumulate: int = 1,
    loss_fn: str | Callable | None = None,
    smoothing: float = 0.9,
    diverge: float = 4.0,
    device: str | torch.device | None = None,
    seed: int = 0,
) -> LRFinderResult:
    """The learning-rate range test on `model` with `data` (anything fit accepts, any batch form).

    Step i of `steps` uses lr = start_lr · (end_lr / start_lr)^(i / (steps - 1)), the same for
    every parameter group. The smoothed loss is an exponential moving average (weight `smoothing`
    on the past), bias-corrected as in Adam. The run stops early when the smoothed loss exceeds
    `diverge` × its minimum, or any loss is not finite. Suggested lr: the lr at the minimum of the
    smoothed loss ÷ 10 (fastai's "lr_min"), a conservative rule that stays below where the loss
    blows up; the minimum is searched after the first tenth of the steps, whose average rests on
    few losses. The lr of steepest descent is returned too.

    The test needs `steps × accumulate` batches in one pass over the data (no epochs are
    repeated); shorter data is an error that says how many it needs. The model's parameters,
    buffers and gradients, and the state of an Optimizer you pass, are restored afterwards; your
    model stays on its device.
    """
    _check(start_lr, end_lr, steps, smoothing, diverge)
    check_int("accumulate", accumulate, note="(micro-batches per optimizer step)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    device = resolve_device(device)
    precision = get_precision(precision, device)
    loader = as_loader(data, batch_size, device, shuffle=True, seed=seed)
    needed = steps * accumulate
    available = length(loader)
    if available is not None and available < needed:
        raise ValueError(_too_short(needed, available, steps, accumulate))

    original_device = next(model.parameters()).device
    saved_model = {name: tensor.detach().clone() for name, tensor in model.state_dict(keep_vars=True).items()}
    saved_grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict()) if isinstance(optimizer, torch.optim.Optimizer) else None
    try:
        model.to(device)
        built = make_optimizer(optimizer, model, start_lr, weight_decay)
        step = TrainStep(model, built, precision, Loss(loss_fn), parameters=model.parameters(), accumulate=accumulate)
        result = _sweep(step, built, loader, device, start_lr, end_lr, steps, accumulate, smoothing, diverge, precision)
    finally:
        with torch.no_grad():
            for name, tensor in model.state_dict(keep_vars=True).items():
                tensor.copy_(saved_model[name])
        for name, p in model.named_parameters():
            p.grad = saved_grads[name]
        if saved_optimizer is not None:
            optimizer.load_state_dict(saved_optimizer)
        model.to(original_device)
    if len(result.lrs) < 3:
        raise ValueError(
            f"the loss diverged after {len(result.lrs)} steps, at lr {result.lrs[-1]:.3g}: start lower (start_lr="
            f"{start_lr / 100:g})."
        )
    return result


def _too_short(needed: int, available: int, steps: int, accumulate: int) -> str:
    return (
        f"lr_find needs {needed} batches ({steps} steps × accumulate={accumulate}) but the data gives {available}; "
        f"pass more data, a smaller batch_size, or fewer steps (steps={max(5, available // accumulate)})."
    )


def _sweep(step, optimizer, loader, device, start_lr, end_lr, steps, accumulate, smoothing, diverge, precision):
    ratio = end_lr / start_lr
    lrs, losses, smoothed = [], [], []
    average, best, stopped = 0.0, math.inf, "reached end_lr"
    batches = iter(loader)
    with training_mode(step.model), precision.flags():
        for index in range(steps):
            lr = start_lr * ratio ** (index / (steps - 1))
            for group in optimizer.param_groups:
                group["lr"] = lr
            total = torch.zeros((), device=device)
            for _ in range(accumulate):
                try:
                    raw = next(batches)
                except StopIteration:
                    raise ValueError(_too_short(steps * accumulate, index * accumulate, steps, accumulate)) from None
                loss, _, _ = step.forward(batch_on_device(raw, device, False))
                step.backward(loss)
                total += loss.detach()
            step.step()
            value = total.item() / accumulate  # one synchronisation per step: divergence is checked at once
            lrs.append(lr)
            losses.append(value)
            if not math.isfinite(value):
                smoothed.append(math.inf)
                stopped = f"diverged at lr {lr:.3g} (loss not finite)"
                break
            average = smoothing * average + (1 - smoothing) * value
            smoothed.append(average / (1 - smoothing ** (index + 1)))
            best = min(best, smoothed[-1])
            if smoothed[-1] > diverge * best:
                stopped = f"diverged at lr {lr:.3g} (smoothed loss > {diverge:g} × its minimum)"
                break
    # The first steps' average rests on few losses (noisy); the minimum is searched after them.
    skip = min(len(smoothed) // 10, len(smoothed) - 1)
    finite = [i for i, value in enumerate(smoothed) if math.isfinite(value) and i >= skip]
    lowest = min(finite, key=smoothed.__getitem__) if finite else 0
    # Slope of the smoothed loss per decade of lr, over the points up to the minimum.
    slopes = [
        (smoothed[i + 1] - smoothed[i]) / math.log10(lrs[i + 1] / lrs[i])
        for i in range(max(lowest, 1))
        if i + 1 < len(smoothed)
    ]
    steepest = lrs[min(range(len(slopes)), key=slopes.__getitem__)] if slopes else lrs[0]
    return LRFinderResult(lrs, losses, smoothed, suggestion=lrs[lowest] / 10, steepest=steepest, stopped=stopped)
