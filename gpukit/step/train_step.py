"""The training step: forward, loss, backward and the optimizer step of one batch, in one precision.

`fit`, `evaluate`, `gk.memory`, `gk.bench`, `gk.distributed.scaling` and the benchmarks all run
this one definition, so what is measured is what is trained.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
from torch import nn

from ..precision import Precision, get_precision
from .batches import Batch, split_batch
from .losses import Loss
from .outputs import _describe, unpack_outputs


class TrainStep:
    """Forward, loss, backward and the optimizer step for one precision, as `fit` runs them.

    model:       what is called (the model itself, or its DDP/compiled wrapper);
    precision:   a Precision, or its name ("fp32", "tf32", "bf16-mixed", "fp16-mixed") for the device
                 of the model's parameters (or `device`);
    parameters:  what the optimizer updates and `clip` bounds (the bare model's parameters);
    accumulate:  micro-batches per optimizer step: each loss is divided by it before backward.

    The pieces are separate methods so that `fit` can skip DDP's all-reduce on micro-batches and
    `gk.memory` can measure each phase; `__call__` runs one whole optimizer step on one batch.
    """

    def __init__(
        self,
        model: Callable,
        optimizer: torch.optim.Optimizer | None,
        precision: Precision | str = "fp32",
        loss: Loss | None = None,
        *,
        parameters=None,
        accumulate: int = 1,
        clip: float | None = None,
        set_to_none: bool = True,
        device: str | torch.device | None = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.parameters = list(parameters if parameters is not None else model.parameters())
        if isinstance(precision, str):
            where = device if device is not None else self.parameters[0].device if self.parameters else "cpu"
            precision = get_precision(precision, where)
        self.precision = precision
        self.loss = loss if loss is not None else Loss()
        self.accumulate = accumulate
        self.clip = clip
        self.set_to_none = set_to_none

    def forward(
        self, batch: Batch, explain: contextlib.AbstractContextManager | None = None
    ) -> tuple[torch.Tensor, object, torch.Tensor | None]:
        """(loss, the outputs as the model returned them, the model's own loss or None) of one batch,
        under autocast. `explain`: a context around the model call alone (fit's first batch: a failure explained)."""
        with self.precision.autocast():
            with explain or contextlib.nullcontext():
                outputs = batch.call(self.model)
            loss = self.loss(outputs, batch.target)
        return loss, outputs, unpack_outputs(outputs)[1]

    def backward(self, loss: torch.Tensor) -> None:
        self.precision.backward(loss / self.accumulate if self.accumulate > 1 else loss)

    def step(self) -> None:
        """Unscale and clip (if asked), update, and zero the gradients."""
        self.precision.step(self.optimizer, self.parameters, self.clip)
        self.optimizer.zero_grad(set_to_none=self.set_to_none)

    def __call__(self, batch) -> torch.Tensor:
        """One optimizer step on one batch of any accepted form; returns the detached loss."""
        loss, _, _ = self.forward(split_batch(batch))
        self.backward(loss)
        self.step()
        return loss.detach()


def forward_backward(model: nn.Module, batch, loss: Loss | None = None, *, backward: bool = True) -> None:
    """Forward, loss and (with `backward`) backward of one batch, no optimizer: what
    `gk.bench.flops_per_step` counts. A bare tensor is the inputs alone: backward then starts
    from the sum of the outputs."""
    if isinstance(batch, torch.Tensor):
        outputs = model(batch)
        prediction, model_loss = unpack_outputs(outputs)
        if model_loss is None and prediction is None:
            raise ValueError(
                f"the model returned {_describe(outputs)}, with no prediction to start backward from; pass a whole "
                "batch (inputs, target) and a loss_fn."
            )
        value = model_loss if model_loss is not None else prediction.float().sum()
    else:
        batch = split_batch(batch)
        value = (loss or Loss())(batch.call(model), batch.target)
    if backward:
        value.backward()


@contextlib.contextmanager
def training_mode(model: nn.Module, training: bool = True):
    """Put `model` in training (or eval) mode and restore the mode of every submodule afterwards."""
    modes = [(module, module.training) for module in model.modules()]
    model.train(training)
    try:
        yield model
    finally:
        for module, mode in modes:
            module.training = mode
