"""The kit's built-in losses of a prediction and a target: cross-entropy (also with label smoothing in training only,
as gk.CrossEntropy) and mean squared error, each checking the shapes and dtypes it is given with advice
(gpukit.step.losses resolves which loss a step uses).
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .batches import IGNORE_INDEX
from .outputs import class_dimension


def cross_entropy(prediction: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over scored targets, classes in the last dimension of `prediction`.

    (B, C) with (B,), (B, T, V) with (B, T); also PyTorch's own layout with classes in dimension 1
    ((B, C, H, W) with (B, H, W)). Targets equal to IGNORE_INDEX (-100) are not scored.
    """
    _check_classification(prediction, target)
    return _cross_entropy(prediction, as_class_indices(target), label_smoothing)


class CrossEntropy:
    """The built-in cross-entropy with label smoothing in training: fit(loss_fn=gk.CrossEntropy(label_smoothing=0.1))
    spreads 0.1 of each target's probability over all classes (PyTorch's F.cross_entropy does the smoothing). Held-out
    data is scored without it (fit's eval_loss, gk.evaluate), so eval_loss means the same with and without smoothing.
    Shapes and ignored targets as `cross_entropy`; a model's own loss is not used in its place.

    label_smoothing: in [0, 1); 0 is plain cross-entropy. fit's label_smoothing=0.1 keyword still works: it is this.
    """

    def __init__(self, label_smoothing: float = 0.0):
        if isinstance(label_smoothing, bool) or not isinstance(label_smoothing, (int, float)):
            raise TypeError(f"label_smoothing must be a number in [0, 1), got {label_smoothing!r}.")
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing!r}.")
        self.label_smoothing = label_smoothing

    def __call__(self, prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return cross_entropy(prediction, target, self.label_smoothing)

    def __eq__(self, other) -> bool:
        return isinstance(other, CrossEntropy) and other.label_smoothing == self.label_smoothing

    def __hash__(self) -> int:
        return hash(self.label_smoothing)

    def __repr__(self) -> str:
        return f"CrossEntropy(label_smoothing={self.label_smoothing!r})"


def _cross_entropy(prediction: torch.Tensor, target: torch.Tensor, label_smoothing: float) -> torch.Tensor:
    """cross_entropy of checked int64 targets. (B, T, V) with (B, T) as (B·T, V) with (B·T,); (B, C) as it is: a
    reshape of a tensor that needs gradients is a view in the graph too, 10 µs a step for nothing (same bits)."""
    if prediction.dim() != 2 and prediction.shape[:-1] == target.shape:
        prediction, target = prediction.reshape(-1, prediction.shape[-1]), target.reshape(-1)
    return F.cross_entropy(prediction, target, ignore_index=IGNORE_INDEX, label_smoothing=label_smoothing)


def as_class_indices(target: torch.Tensor) -> torch.Tensor:
    """Integer class targets as int64, which cross-entropy and gather take: int32, int16, int8 and uint8 labels (a
    NumPy array's, a uint8 mask's) are converted, one small copy; int64 ones are returned as they are."""
    return target if target.dtype == torch.int64 else target.long()


def mean_squared_error(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error; prediction and target must have the same shape (no broadcasting)."""
    if not target.is_floating_point():
        raise ValueError(f"loss_fn='mse' needs a floating-point target, got {target.dtype}; convert it with .float().")
    _check_same_shape(prediction, target, "mse")
    return F.mse_loss(prediction, target)


def _check_classification(prediction: torch.Tensor, target: torch.Tensor) -> None:
    if target.is_floating_point():
        raise ValueError(
            f"cross-entropy needs integer class targets, got {target.dtype}; for regression pass loss_fn='mse' "
            "(or your own function)."
        )
    if target.dtype == torch.bool or target.is_complex():
        raise ValueError(
            f"cross-entropy needs integer class targets, got {target.dtype}; for two classes convert them with "
            "target.long() (the model then needs 2 outputs), or pass loss_fn=F.binary_cross_entropy_with_logits "
            "with target.float() and one output."
        )
    if class_dimension(prediction, target) is None:
        raise ValueError(
            f"cross-entropy cannot match outputs of shape {tuple(prediction.shape)} with targets of shape "
            f"{tuple(target.shape)}: expected the outputs to be the targets' shape plus a class dimension at the "
            "end, e.g. (B, C) for (B,) or (B, T, V) for (B, T). If the outputs are no class scores, pass loss_fn= "
            "('mse', or your function of (outputs, target))."
        )


def _check_same_shape(prediction: torch.Tensor, target: torch.Tensor, name: str) -> None:
    if prediction.shape != target.shape:
        raise ValueError(
            f"{name}: outputs of shape {tuple(prediction.shape)} and targets of shape {tuple(target.shape)} would only "
            "broadcast, which silently computes the wrong loss; make them the same shape (e.g. outputs.squeeze(-1) "
            "or target.unsqueeze(-1))."
        )
