"""`lr_find`: the learning-rate range test (Leslie Smith 2015; fastai's and Lightning's lr finder).

Train for a short run while the learning rate grows exponentially from `start_lr` to `end_lr`,
record the loss at each step, and stop once it diverges. Where the loss falls fastest the model
learns; where it turns up the learning rate is too large. The model and the optimizer are restored
to what they were before, bit for bit.

The losses of single steps are noisy (one batch each), so the suggestion reads a smoothed curve:
a running median centred on each step (a moving average that lags would move every feature to a
higher lr, and one diverging step would drag it up), from which the noise of one step is measured.
The suggestion is the largest lr at which that curve is still at its lowest level, within the noise,
÷ 10. On a clean curve that is fastai's "minimum ÷ 10"; on a curve that stays flat within the noise
over decades (a model that learns little in a short test, such as a ViT), the minimum is wherever
the noise dipped, often in the first steps, while the end of the flat stretch is where the learning
rate starts to hurt.

A sweep that ends before the loss rises (end_lr too low, or too few steps to tell a rise from the noise) has no edge
to read: its suggestion is the sweep's end ÷ 10, a bound of the rule's (the edge lies beyond), not a reading. The
result says so (`rose` is False, `stopped` says why) and lr_find warns: a run at that lr can lower the training
loss while the model fails on held-out data (BatchNorm's running statistics lagging weights that moved too fast).
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ..data.loaders import worker_crashes_explained
from ..env import resolve_device
from ..optim import check_lr, make_optimizer
from ..plots import plot_lr_find
from ..precision import Precision, get_precision
from ..step import Loss, TrainStep, training_mode
from ..validation import check_int, check_seed
from .batch_checks import batch_problem
from .checks import NonFiniteInputError, describe
from .data import as_loader, batch_on_device, exact_device

SUGGESTION_RULE = "the largest lr at which the smoothed loss is still at its lowest level ÷ 10"
NOISE_BAND = 6.0  # the lowest level: within this many standard deviations of the smoothed curve's noise
# The fewest steps, and the fewest finite steps before a divergence, that show a curve: the suggestion reads medians of
# 5 steps, and on a made valley (6 decades, noise 0.03, 10 seeds) sweeps of 5 and 8 steps put it where the loss already
# rose (5: always the sweep's end), while from 15 steps on it was the bottom's end every time (tests/test_lr_find.py).
MIN_STEPS = 20


@dataclass
class LRFinderResult:
    """What the range test measured. `suggestion` follows `rule`. `steepest` is the lr where the
    smoothed loss falls fastest per decade of lr (a least-squares slope over one window, searched
    from the first tenth of the steps to the lowest point), another common choice: bolder, and
    meaningful only where the loss clearly falls."""

    lrs: list[float]
    losses: list[float]  # the loss of each step, as measured
    smoothed: list[float]  # running median of `losses` over `window` steps centred on each (what the rules read)
    suggestion: float
    steepest: float
    lowest_lr: float  # where the smoothed loss is lowest (the first tenth of the steps left out)
    noise: (
        float  # standard deviation of one step's loss around the curve (robust: from neighbouring steps' differences)
    )
    window: int = 1  # steps in each median
    rule: str = SUGGESTION_RULE
    stopped: str = ""  # why the run ended: "diverged at lr …" or "reached end_lr"
    rose: bool = True  # whether the sweep saw the loss rise above its lowest level; if not, `suggestion` is a bound

    @property
    def best_lr(self) -> float:
        """The largest lr at which the smoothed loss is still at its lowest level: beyond it, the loss rises (where
        `rose`; else the sweep's last lr, and the rise lies beyond it)."""
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
    check_int(
        "steps",
        steps,
        minimum=MIN_STEPS,
        note=f"(optimizer steps of the sweep: fewer show no curve to read a suggestion from; pass steps={MIN_STEPS} "
        "or more, 100 by default; data shorter than the sweep is read again)",
    )
    if not 0 <= smoothing < 1:
        raise ValueError(f"smoothing must lie in [0, 1) (0: no smoothing), got {smoothing!r}.")
    if not diverge > 1:
        raise ValueError(
            f"diverge must be > 1 (stop when the loss rises above its minimum by (diverge - 1) × its scale), got "
            f"{diverge!r}."
        )


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
    every parameter group. The run stops early when an exponential moving average of the loss
    (weight `smoothing` on the past, bias-corrected as in Adam) rises above its minimum by more than
    (diverge - 1) × the loss's scale, the larger of |minimum| and the spread of the first 5 steps' losses
    (for a positive loss with little noise: exceeds `diverge` × its minimum), or a loss is not finite;
    later steps are not read. A loss of any sign works: one near 0 or negative (a policy-gradient loss) is
    judged against its spread.

    Suggested lr (`suggestion`): the largest lr at which the smoothed loss (a running median over
    about a twentieth of the steps either side) is still at its lowest level, within NOISE_BAND
    standard deviations of the smoothed curve's noise, ÷ 10: beyond that lr the loss rises, and a
    tenth of it stays clear of the edge. The first tenth of the steps is left out of the search.
    `steepest` (where the smoothed loss falls fastest) and `lowest_lr` are returned too.

    Too few steps to show a curve are refused: `steps` below MIN_STEPS (20) before any work, and a sweep whose
    loss diverged before MIN_STEPS finite steps with a ValueError that says which end_lr (or start_lr) to pass;
    a suggestion read from a handful of steps would be where the loss already rises, whatever it did.

    Data shorter than `steps × accumulate` batches is read again, pass after pass (each in a new
    order where the loader shuffles), as fastai's lr_find does; a generator read to its end is an
    error. The model's parameters, buffers and gradients, and the state of an Optimizer you pass,
    are restored afterwards; your model stays on its device.
    """
    _check(start_lr, end_lr, steps, smoothing, diverge)
    check_int("accumulate", accumulate, note="(micro-batches per optimizer step)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    device = resolve_device(device)
    precision = get_precision(precision, device)
    loader = as_loader(data, batch_size, device, shuffle=True, seed=check_seed(seed))

    original_device = next(model.parameters()).device
    saved_model = {name: _copy(value) for name, value in model.state_dict().items()}
    saved_grads = {name: None if p.grad is None else p.grad.detach().clone() for name, p in model.named_parameters()}
    saved_optimizer = copy.deepcopy(optimizer.state_dict()) if isinstance(optimizer, torch.optim.Optimizer) else None
    try:
        model.to(device)
        built = make_optimizer(optimizer, model, start_lr, weight_decay)
        step = TrainStep(model, built, precision, Loss(loss_fn), parameters=model.parameters(), accumulate=accumulate)
        lrs, losses, stopped = _sweep(
            step, built, loader, device, start_lr, end_lr, steps, accumulate, smoothing, diverge, precision
        )
    finally:
        _put_back(model, saved_model)
        for name, p in model.named_parameters():
            p.grad = saved_grads[name]
        if saved_optimizer is not None:
            optimizer.load_state_dict(saved_optimizer)
        model.to(original_device)
    _check_enough_before_divergence(lrs, losses, start_lr)
    result = _suggest(lrs, losses, stopped)
    if not result.rose:
        warnings.warn(
            f"lr_find: the loss did not rise above its lowest level within the sweep (up to lr {lrs[-1]:.3g}), so "
            f"the suggestion {result.suggestion:.3g} is the sweep's end ÷ 10, a bound, not read from the curve. Pass "
            f"a larger end_lr or more steps (now {steps}) until the loss rises, and judge a run at the lr on held-out "
            "data (gk.evaluate): its training loss can fall while the model fails in eval mode.",
            UserWarning,
            stacklevel=2,
        )
    return result


def _copy(value):
    """A tensor's copy, or a deep copy of a module's extra state (anything get_extra_state returns)."""
    return value.detach().clone() if isinstance(value, torch.Tensor) else copy.deepcopy(value)


def _put_back(model: nn.Module, saved: dict) -> None:
    """The model's state as lr_find found it, exactly, or a RuntimeError with nothing of it changed. Loaded as
    load_state_dict loads it (a module's own loading runs: its extra state too), after each buffer that the sweep's
    forwards resized (a fake-quant observer's, from (0,) to one value per channel) is given its saved shape back."""
    now = model.state_dict(keep_vars=True)
    parameters = {id(parameter) for parameter in model.parameters()}
    changed = [f"{name} is new" for name in now.keys() - saved.keys()]
    changed += [f"{name} is gone" for name in saved.keys() - now.keys()]
    changed += [
        f"the parameter {name} is {tuple(value.shape)}, was {tuple(saved[name].shape)}"
        for name, value in now.items()
        if id(value) in parameters and name in saved and value.shape != saved[name].shape
    ]
    if changed:
        raise RuntimeError(
            f"lr_find cannot put the model back as it was: its state changed form during the sweep "
            f"({'; '.join(sorted(changed)[:3])}). Nothing was put back: the model holds the sweep's last weights; "
            "build it again (and run lr_find on a copy: copy.deepcopy(model)) before training."
        )
    with torch.no_grad():
        for name, value in now.items():
            if isinstance(value, torch.Tensor) and value.shape != saved[name].shape:
                value.resize_(saved[name].shape)  # a buffer (parameters keep their shape: checked above)
    model.load_state_dict(saved)


def _check_enough_before_divergence(lrs: list[float], losses: list[float], start_lr: float) -> None:
    """Refuse to suggest from a sweep that diverged before MIN_STEPS finite steps: too few to show a curve."""
    finite = len(losses) if math.isfinite(losses[-1]) else len(losses) - 1
    if finite >= MIN_STEPS:
        return
    if finite <= _Divergence.SETTLE:  # (nearly) at once, before a rise is judged: the range starts too high
        advice = f"start lower (start_lr={start_lr / 100:g})"
    else:  # every step of a sweep that ends there lies below it
        advice = f"pass end_lr={lrs[-1]:.3g}, where it diverged, so that the whole sweep lies below it"
    raise ValueError(
        f"the loss diverged after {len(lrs)} steps, at lr {lrs[-1]:.3g}: {finite} finite steps are too few to read a "
        f"suggestion from (lr_find needs {MIN_STEPS} before it diverges); {advice}."
    )


def _cycle(loader) -> Iterator:
    """The loader's batches pass after pass, each pass in a new order where the loader shuffles (as fastai's
    lr_find trains as many epochs as its steps need)."""
    for index in itertools.count():
        for owner in (loader, getattr(loader, "sampler", None)):
            if index and hasattr(owner, "set_epoch"):
                owner.set_epoch(index)
                break
        empty = True
        for raw in loader:
            empty = False
            yield raw
        if empty and index == 0:
            raise ValueError("lr_find got no batch: the data is empty, or smaller than one batch with drop_last.")
        if empty:
            raise ValueError(
                "lr_find read the data to its end, and reading it again gave no batch: a generator or iterator can be "
                "read only once. Pass a list, a Dataset or a DataLoader, or fewer steps."
            )


class _Divergence:
    """Whether the loss's moving average has risen too far above its lowest level, for a loss of any sign.

    "diverge × its minimum" means nothing for a loss near 0 or below it (a policy-gradient loss: a step of noise is
    many times its minimum; a negative minimum makes every later loss "diverge"). The rise is measured instead against
    the loss's own scale: the larger of |minimum| and the spread (standard deviation) of the first SETTLE steps'
    losses, at the sweep's lowest lrs, where the model barely moves. A rise above the minimum by more than
    (diverge - 1) × that scale diverges: for a positive loss whose noise is small beside it, diverge × its minimum."""

    SETTLE = 5  # steps whose losses measure the spread; the rise is judged from the next one on

    def __init__(self, smoothing: float, diverge: float):
        self.smoothing, self.diverge = smoothing, diverge
        self.average, self.best, self.first = 0.0, math.inf, []

    def add(self, index: int, value: float) -> bool:
        """Add step `index`'s loss (finite); True once the moving average diverged."""
        self.average = self.smoothing * self.average + (1 - self.smoothing) * value
        level = self.average / (1 - self.smoothing ** (index + 1))  # bias-corrected: the first steps' average is not ~0
        self.best = min(self.best, level)
        if len(self.first) < self.SETTLE:
            self.first.append(value)
            return False
        scale = max(abs(self.best), statistics.pstdev(self.first))
        return level - self.best > (self.diverge - 1) * scale


def _sweep(step, optimizer, loader, device, start_lr, end_lr, steps, accumulate, smoothing, diverge, precision):
    """(lrs, losses, why it stopped) of the sweep; it stops at the first loss that is not finite, or once the
    moving average diverged (_Divergence)."""
    ratio = end_lr / start_lr
    lrs, losses = [], []
    divergence, stopped = _Divergence(smoothing, diverge), "reached end_lr"
    batches = _cycle(loader)
    device = exact_device(device)  # "cuda:0", not "cuda": batch_on_device's fast path compares tensors' devices
    with training_mode(step.model), precision.flags(), worker_crashes_explained():
        for index in range(steps):
            lr = start_lr * ratio ** (index / (steps - 1))
            for group in optimizer.param_groups:
                group["lr"] = lr
            total, read = torch.zeros((), device=device), []
            for _ in range(accumulate):
                read.append(batch_on_device(next(batches), device, False))
                loss, _, _ = step.forward(read[-1])
                step.backward(loss)
                total += loss.detach()
            step.step()
            value = total.item() / accumulate  # one synchronisation per step: divergence is checked at once
            lrs.append(lr)
            losses.append(value)
            if not math.isfinite(value):
                _check_data(read, step.loss.ignore_index, index, lr)  # NaN in the data is no divergence
                stopped = f"diverged at lr {lr:.3g} (loss not finite)"
                break
            if divergence.add(index, value):
                stopped = (
                    f"diverged at lr {lr:.3g} (moving average of the loss above its minimum by > {diverge - 1:g} × "
                    "the larger of |minimum| and the first steps' spread)"
                )
                break
    return lrs, losses, stopped


def _check_data(batches: list, ignore_index: int, index: int, lr: float) -> None:
    """After a loss that is not finite: a NonFiniteInputError naming the first of the step's batches that holds NaN
    or inf (or scores no target), which no lr causes; nothing if they are clean (then the lr diverged)."""
    for batch in batches:
        problem = batch_problem(batch, ignore_index)
        if problem is not None:
            raise NonFiniteInputError(
                f"lr_find's loss became non-finite at step {index + 1} (lr {lr:.3g}), and a batch that step read "
                f"({describe(batch)}) {problem} The sweep stopped; nothing can be suggested from it until the data is "
                "fixed."
            )


def _suggest(lrs: list[float], losses: list[float], stopped: str) -> LRFinderResult:
    """The suggestion, the steepest descent and the lowest point, read from a running median of the finite losses."""
    count = len(losses) if math.isfinite(losses[-1]) else len(losses) - 1  # a non-finite loss ends the sweep
    half = max(2, round(count / 20))  # steps either side: a tenth of the sweep in each median
    smoothed = _running_median(losses[:count], half)
    skip = max(count // 10, 1)  # the first steps: a median cut short at the edge, and a model still settling
    # One step's noise, robustly: each loss against the mean of its two neighbours, which cancels the curve's own
    # trend where it is straight. For normal noise of deviation σ that difference has deviation σ·√1.5, and 1.4826 ×
    # its median absolute value estimates it. A median of n such losses varies about 1.25 / sqrt(n) as much as one.
    kinks = [abs(losses[i] - (losses[i - 1] + losses[i + 1]) / 2) for i in range(skip, count - 1)]
    noise = 1.4826 * statistics.median(kinks) / math.sqrt(1.5) if kinks else 0.0
    band = NOISE_BAND * 1.25 * noise / math.sqrt(2 * half + 1)
    lowest = min(range(skip, count), key=smoothed.__getitem__)
    edge = lowest
    while edge + 1 < count and smoothed[edge + 1] <= smoothed[lowest] + band:
        edge += 1  # still at the lowest level; the first step above it ends the search (later ones may be diverging)
    rose = not (edge == len(losses) - 1 and stopped == "reached end_lr")  # a divergence is a rise too
    if not rose:
        stopped += (
            " without the loss rising above its lowest level: the suggestion is end_lr ÷ 10, a bound; a larger end_lr "
            "or more steps show where it rises"
        )
    logs = [math.log10(lr) for lr in lrs[:count]]
    slopes = {
        i: _slope(logs[max(0, i - half) : i + half + 1], smoothed[max(0, i - half) : i + half + 1])
        for i in range(skip, lowest + 1)
    }
    steepest = min(slopes, key=slopes.__getitem__)
    return LRFinderResult(
        lrs,
        losses,
        smoothed + [math.inf] * (len(losses) - count),
        suggestion=lrs[edge] / 10,
        steepest=lrs[steepest],
        lowest_lr=lrs[lowest],
        noise=noise,
        window=2 * half + 1,
        stopped=stopped,
        rose=rose,
    )


def _running_median(values: list[float], half: int) -> list[float]:
    """The median of the values from `half` before to `half` after each (fewer at the ends)."""
    return [statistics.median(values[max(0, i - half) : i + half + 1]) for i in range(len(values))]


def _slope(x: list[float], y: list[float]) -> float:
    """Least-squares slope of y against x."""
    mean_x, mean_y = sum(x) / len(x), sum(y) / len(y)
    spread = sum((a - mean_x) ** 2 for a in x)
    return sum((a - mean_x) * (b - mean_y) for a, b in zip(x, y)) / spread if spread else 0.0
