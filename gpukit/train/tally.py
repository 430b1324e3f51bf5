"""Running sums over a pass of the data, for `fit`'s epochs and for `evaluate`."""

from __future__ import annotations

import keyword
from collections.abc import Callable, Mapping

import torch

from ..step import Batch, Loss

RESERVED = ("loss", "accuracy", "samples", "tokens")


def check_metrics(metrics) -> dict[str, Callable]:
    """{name: fn(outputs, target) -> number}: names that make columns, functions that can be called."""
    if metrics is None:
        return {}
    if not isinstance(metrics, Mapping):
        raise TypeError(
            f"metrics must be a dict of name → function(outputs, target), got {type(metrics).__name__}; e.g. "
            "metrics={'mae': lambda outputs, target: (outputs - target).abs().mean()}."
        )
    for name, fn in metrics.items():
        if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name) or name in RESERVED:
            raise ValueError(
                f"metric name {name!r} cannot be a column: use a Python identifier other than {', '.join(RESERVED)}."
            )
        if not callable(fn):
            raise TypeError(f"metric {name!r} is a {type(fn).__name__}, not a function of (outputs, target).")
    return dict(metrics)


class Tally:
    """Sums of loss, accuracy and metrics over batches, kept on the device.

    Adding a batch never waits for the GPU; `read()` synchronises once. The loss and each
    metric are averaged over samples, weighted by batch size; accuracy is correct over scored
    targets (token accuracy for sequences, targets equal to -100 not scored). Whether accuracy
    applies is decided at the first batch (see Loss.tracks_accuracy).
    """

    def __init__(self, device: torch.device, loss: Loss, metrics: dict[str, Callable]):
        self.loss = loss
        self.metrics = metrics
        self.accuracy: bool | None = None
        self.samples = 0
        zero = torch.zeros((), device=device, dtype=torch.float64)
        self.sums = {"loss": zero.clone(), "correct": zero.clone(), "scored": zero.clone()}
        self.sums |= {name: zero.clone() for name in metrics}

    def add(self, batch: Batch, loss: torch.Tensor, prediction, model_loss=None) -> None:
        if self.accuracy is None:
            self.accuracy = prediction is not None and self.loss.tracks_accuracy(batch, model_loss)
        size = batch.size
        self.samples += size
        self.sums["loss"] += loss.detach() * size
        if self.accuracy:
            correct, scored = self.loss.correct(prediction.detach(), batch.target)
            self.sums["correct"] += correct
            self.sums["scored"] += scored
        if self.metrics:
            with torch.no_grad():
                output = prediction.detach() if prediction is not None else None
                for name, fn in self.metrics.items():
                    value = fn(output, batch.target)
                    if isinstance(value, torch.Tensor):
                        value = value.detach().reshape(()).to(self.sums[name].dtype)
                    self.sums[name] += value * size

    def tensors(self) -> list[torch.Tensor]:
        """What ranks add up in a distributed job (with `samples`)."""
        return list(self.sums.values())

    def replace(self, values, samples: int) -> None:
        self.sums = dict(zip(self.sums, values))
        self.samples = samples

    def read(self, prefix: str = "") -> dict:
        """{prefix + "loss", prefix + "accuracy" (if it applies), prefix + each metric}: one synchronisation."""
        values = dict(zip(self.sums, torch.stack(list(self.sums.values())).tolist()))
        samples = max(self.samples, 1)
        row = {f"{prefix}loss": values["loss"] / samples}
        if self.accuracy:
            row[f"{prefix}accuracy"] = values["correct"] / values["scored"] if values["scored"] else None
        row |= {f"{prefix}{name}": values[name] / samples for name in self.metrics}
        return row
