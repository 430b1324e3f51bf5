"""Optimizers and learning-rate schedules by name: the one place a string becomes an object."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

SCHEDULES = ("onecycle", "linear", "constant")
OPTIMIZERS = ("sgd", "adamw")
DEFAULT_LR = 0.05  # fit's peak learning rate for an optimizer given by name


def check_lr(lr) -> None:
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise ValueError(f"lr must be a positive, finite number, got {lr!r}.")


def make_optimizer(
    optimizer: str | torch.optim.Optimizer | Callable, parameters: Iterable, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """'sgd' (Nesterov momentum 0.9), 'adamw', an optimizer, or a function of the parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        built = optimizer(parameters)
        if not isinstance(built, torch.optim.Optimizer):
            raise TypeError(f"the optimizer function returned {type(built).__name__}, not a torch.optim.Optimizer.")
        return built
    if optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    if optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    raise ValueError(
        f"optimizer={optimizer!r} is unknown; use one of {', '.join(map(repr, OPTIMIZERS))}, an Optimizer, or a "
        "function of the parameters."
    )


def make_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, total_steps: int | None, warmup: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then one-cycle (cosine) decay, linear decay to zero, or constant.

    The peak is each parameter group's learning rate. `warmup` is a fraction of all steps (< 1)
    or a number of steps (>= 1). The one-cycle schedule is torch's OneCycleLR, with the learning
    rate only (momentum is left as set). `total_steps=None` (an unknown length) is allowed only
    for the constant schedule with warm-up given in steps.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")
    if total_steps is None:
        if schedule != "constant" or 0 < warmup < 1:
            raise ValueError(
                f"the {schedule!r} schedule needs the number of steps; pass max_steps, or use schedule='constant' "
                "with warmup in steps (warmup=0 or e.g. warmup=100)."
            )
        total_steps = math.inf
    total_steps = max(total_steps, 1)
    warmup_steps = warmup * total_steps if warmup < 1 else warmup
    warmup_steps = min(max(warmup_steps, 0), total_steps)
    if schedule == "onecycle":
        peak = [group["lr"] for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=peak, total_steps=total_steps + 1, pct_start=max(warmup_steps / (total_steps + 1), 1e-6),
            anneal_strategy="cos", cycle_momentum=False, div_factor=25.0, final_div_factor=1e4,
        )  # fmt: skip

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(total_steps - warmup_steps, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
