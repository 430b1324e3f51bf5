"""`evaluate()`: loss, accuracy (where it means something) and your metrics on held-out data."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from ..env import resolve_device
from ..precision import Precision, get_precision
from ..step import Loss, training_mode
from .data import as_loader, batch_on_device
from .tally import Tally, check_metrics


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data,
    *,
    batch_size: int | None = 512,
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    channels_last: bool = False,
    loss_fn: str | Callable | Loss | None = None,
    metrics: dict[str, Callable] | None = None,
) -> dict:
    """Mean loss, accuracy (where it means something, see gpukit.step) and `metrics` of `model` on
    `data` (a Dataset, a loader or a re-iterable of batches of any form), in eval mode.

    Returns {"loss", "accuracy" (where it applies), one entry per metric, "samples", and "tokens"
    for sequence data}. The loss and metrics are means over samples; accuracy is over scored targets.
    """
    device = resolve_device(device) if device is not None else next(model.parameters()).device
    precision = get_precision(precision, device)
    loss = loss_fn if isinstance(loss_fn, Loss) else Loss(loss_fn)
    metrics = check_metrics(metrics)
    if isinstance(data, torch.utils.data.Dataset) is False:
        batch_size = None  # a loader or an iterable brings its own batches
    loader = as_loader(data, batch_size, device, shuffle=False, channels_last=channels_last, shard=False)
    tally = Tally(device, loss, metrics)
    with training_mode(model, False):
        for raw in loader:
            batch = batch_on_device(raw, device, channels_last)
            with precision.autocast():
                outputs = batch.call(model)
                value = loss(outputs, batch.target)
            tally.add(batch, value, outputs)
    if tally.samples == 0:
        raise ValueError("evaluate() got no batches; the dataset is empty or smaller than one batch with drop_last.")
    return tally.read(tokens=True) | {"samples": tally.samples}
