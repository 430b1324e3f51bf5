"""Running sums over a pass of the data, for `fit`'s epochs and for `evaluate`."""

from __future__ import annotations

import keyword
import numbers
from collections.abc import Callable, Mapping

import torch

from .. import distributed
from ..step import Batch, Loss, unpack_outputs

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


def check_metric_value(name: str, value) -> None:
    """One number per batch, as a metric must return: checked on the first batch, before the first optimizer step."""
    if isinstance(value, numbers.Real) or (isinstance(value, torch.Tensor) and value.numel() == 1):
        return
    if value is None:
        got = "None (is its `return` missing?)"
    elif isinstance(value, torch.Tensor):
        got = f"a tensor of shape {tuple(value.shape)}"
    else:
        got = f"a {type(value).__name__}"
    raise ValueError(
        f"metric {name!r} returned {got}; a metric returns one number per batch (a Python number or a one-element "
        "tensor), e.g. lambda outputs, target: (outputs - target).abs().mean()."
    )


class RunningSums:
    """Named sums kept on the device in float64: adding never waits for the GPU, `read()` waits once,
    and `over_ranks()` adds them up across a distributed job in one all-reduce."""

    def __init__(self, device: torch.device, names):
        zero = torch.zeros((), device=device, dtype=torch.float64)
        self.values = {name: zero.clone() for name in names}

    def add(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            value = value.detach().reshape(()).to(torch.float64)
        self.values[name] += value

    def over_ranks(self, *counts: int) -> tuple[int, ...]:
        """Sum every value, and the host-side `counts` given, over all ranks; returns the counts' sums."""
        values = distributed.sum_over_ranks(*self.values.values(), *counts)
        self.values = dict(zip(self.values, values[: len(self.values)]))
        return tuple(values[len(self.values) :])

    def read(self) -> dict[str, float]:
        return dict(zip(self.values, torch.stack(list(self.values.values())).tolist()))


class Tally:
    """Loss, accuracy, metrics and tokens over a pass of the data (`fit`'s epochs, `evaluate`).

    The loss and each metric are averaged over samples, weighted by batch size; accuracy is
    correct over scored targets (token accuracy for sequences, targets equal to -100 not
    scored). Whether accuracy applies is decided at the first batch (Loss.tracks_accuracy). Metrics
    get the outputs as the model returned them (no gradients are recorded).
    """

    def __init__(self, device: torch.device, loss: Loss, metrics: dict[str, Callable]):
        self.loss = loss
        self.metrics = metrics
        self.accuracy: bool | None = None
        self.samples = 0
        self.sequences = False  # whether tokens were counted (sequence data)
        self.sums = RunningSums(device, ["loss", "correct", "scored", "tokens", *metrics])

    def add(self, batch: Batch, loss: torch.Tensor, outputs) -> None:
        """One batch: its loss, and what the model returned, as it returned it (metrics get that)."""
        first = self.accuracy is None
        if first:
            self.accuracy = self.loss.tracks_accuracy(batch, outputs)
        size = batch.size
        self.samples += size
        self.sums.add("loss", loss.detach() * size)
        if self.accuracy:
            prediction, _ = unpack_outputs(outputs)
            correct, scored = self.loss.correct(prediction.detach(), batch.target)
            self.sums.add("correct", correct)
            self.sums.add("scored", scored)
        if batch.is_sequence:
            self.sequences = True
            self.sums.add("tokens", batch.count_tokens())
        if self.metrics:
            with torch.no_grad():
                for name, fn in self.metrics.items():
                    value = fn(outputs, batch.target)
                    if first:
                        check_metric_value(name, value)
                    self.sums.add(name, value * size)

    def over_ranks(self) -> None:
        """Add up every rank's sums and samples (one all-reduce). Whether accuracy applies and whether tokens
        were counted travel with them: a rank that saw no batch learns them from the others, and every rank
        reports the same columns."""
        self.samples, self.accuracy, self.sequences = self.sums.over_ranks(
            self.samples, bool(self.accuracy), self.sequences
        )

    def read(self, prefix: str = "", tokens: bool = False) -> dict:
        """{prefix + "loss", prefix + "accuracy" (if it applies), prefix + each metric, and with `tokens` the
        scored tokens of sequence data}: one synchronisation."""
        values = self.sums.read()
        samples = max(self.samples, 1)
        row = {f"{prefix}loss": values["loss"] / samples}
        if self.accuracy:
            row[f"{prefix}accuracy"] = values["correct"] / values["scored"] if values["scored"] else None
        row |= {f"{prefix}{name}": values[name] / samples for name in self.metrics}
        if tokens and self.sequences:
            row[f"{prefix}tokens"] = int(values["tokens"])
        return row
