"""What a step minimises: the loss of what the model returned against the batch's target, and whether
accuracy means something for them.

The loss is, in this order:
- `loss_fn(outputs, target)` with your own function: it receives the outputs exactly as the model
  returned them (the whole tuple or dict), and the target (None for a dict batch without "labels"; a
  dict of tensors for a target per task). It returns a scalar tensor, or a dict of named scalar losses
  ({"cls": …, "reg": …}, a multi-task loss): their sum is minimised and each is a column (loss_cls);
- a built-in loss ("cross_entropy", "mse", or one of PyTorch's: a torch.nn.functional loss such as
  F.cross_entropy, an nn.Module loss such as nn.MSELoss()) of the prediction and the target;
- with no loss_fn, the model's own loss; else cross-entropy of the prediction when the target is
  an integer tensor ((B, C) with (B,), (B, T, V) with (B, T), (B, C, H, W) with (B, H, W); entries
  equal to -100 ignored). A floating-point target needs an explicit loss_fn. Other scalar tensors
  the model returns beside its prediction (a mixture of experts' load-balancing loss in
  `(logits, aux_loss)`) are not added to a loss computed from the prediction: fit warns, and your
  loss_fn adds them (`Loss.ignored_scalars`).

Accuracy is reported only where it means something: an integer target, and a floating-point
prediction that is the target's shape plus one class dimension of at least two classes (last, or
second as in (B, C, H, W)), with every target a class (or -100). Not with the model's own loss over
sequences (a causal LM shifts its labels inside), nor from a tuple's first tensor when your own
loss_fn gets the tuple (a VAE's reconstruction is no class scores), and never from other parts.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from . import builtin_losses
from .batches import IGNORE_INDEX, Batch, BatchError
from .builtin_losses import (
    CrossEntropy,
    _check_classification,
    _check_same_shape,
    _cross_entropy,
    as_class_indices,
    mean_squared_error,
)
from .outputs import (
    _describe,
    _is_scalar,
    class_dimension,
    describe_value,
    is_list_of_dicts,
    loss_parts,
    named_outputs,
    summed_losses,
    unpack_outputs,
)

LOSSES = ("cross_entropy", "mse")


def _not_a_scalar(value) -> str:
    if value is None:
        return "None (is its `return` missing?)"
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return f"a {type(value).__name__}, not a tensor"


def _takes_a_tensor(loss_fn) -> bool:
    """PyTorch's losses (an nn loss module, a torch.nn.functional function) and the kit's own take the
    prediction tensor; any other function is the user's, and gets the outputs as the model returned them."""
    return isinstance(loss_fn, nn.modules.loss._Loss) or getattr(loss_fn, "__module__", None) in (
        "torch.nn.functional",
        __name__,
        builtin_losses.__name__,
    )


# Losses that compare outputs and targets element by element: a shape mismatch is always a bug.
_ELEMENTWISE_FUNCTIONS = (
    F.mse_loss,
    F.l1_loss,
    F.smooth_l1_loss,
    F.huber_loss,
    F.binary_cross_entropy,
    F.binary_cross_entropy_with_logits,
)
_ELEMENTWISE_MODULES = (nn.MSELoss, nn.L1Loss, nn.SmoothL1Loss, nn.HuberLoss, nn.BCELoss, nn.BCEWithLogitsLoss)


class Loss:
    """What a step minimises, resolved once from `loss_fn` (see the module docstring).

    `takes_outputs`: the loss_fn is your own function, called with the outputs as the model returned
    them; otherwise losses are computed from the prediction found in them. `tracks_accuracy(batch,
    outputs)` says whether accuracy means something for a pass over the data (see the module docstring).
    """

    def __init__(self, loss_fn: str | Callable | None = None, *, evaluation: bool = False, check_targets: bool = True):
        # A CrossEntropy(label_smoothing) smooths in training only: held-out data is scored without it (evaluation).
        smoothing = loss_fn.label_smoothing if isinstance(loss_fn, CrossEntropy) else 0.0
        self.label_smoothing = 0.0 if evaluation else smoothing
        self.ignore_index = IGNORE_INDEX
        # Class targets are checked against the number of outputs once, on the first batch (one
        # synchronisation): on a GPU an out-of-range target is a device-side assert that ends the process.
        self.check_targets = check_targets
        self.diagnoses = check_targets  # read the targets when the loss fails (not on the meta device or fake ones)
        self.classes: int | None = None  # the prediction's classes, once the first batch's targets were checked
        self.takes_outputs = False
        if (
            loss_fn is None
            or isinstance(loss_fn, CrossEntropy)
            or loss_fn == "cross_entropy"
            or loss_fn is F.cross_entropy
        ):
            self.name, self.fn, self.explicit = "cross_entropy", None, loss_fn is not None
        elif loss_fn == "mse":
            self.name, self.fn, self.explicit = "mse", mean_squared_error, True
        elif isinstance(loss_fn, str):
            raise ValueError(
                f"loss_fn={loss_fn!r} is unknown; use one of {', '.join(map(repr, LOSSES))} or a function."
            )
        elif isinstance(loss_fn, type):  # nn.CrossEntropyLoss, gk.CrossEntropy: a class, not yet a loss
            raise TypeError(
                f"loss_fn={loss_fn.__name__} is a class, not a loss: pass an instance, e.g. {loss_fn.__name__}()."
            )
        elif callable(loss_fn):
            self.name, self.fn, self.explicit = getattr(loss_fn, "__name__", type(loss_fn).__name__), loss_fn, True
            self.takes_outputs = not _takes_a_tensor(loss_fn)
            if isinstance(loss_fn, nn.CrossEntropyLoss):
                self.name, self.ignore_index = "cross_entropy", loss_fn.ignore_index
        else:
            raise TypeError(f"loss_fn must be a function, 'cross_entropy' or 'mse', got {type(loss_fn).__name__}.")
        self.elementwise = loss_fn in _ELEMENTWISE_FUNCTIONS or isinstance(loss_fn, _ELEMENTWISE_MODULES)

    def __repr__(self) -> str:
        return f"Loss({self.name!r})"

    def uses_model_loss(self, model_loss) -> bool:
        return model_loss is not None and not self.explicit

    def __call__(self, outputs, target) -> torch.Tensor:
        """The scalar loss (float32) of one batch from what the model returned and the batch's target."""
        return self.with_parts(outputs, target)[0]

    def with_parts(self, outputs, target) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(the scalar loss (float32), its named parts by column name, detached): the dict of losses your loss_fn
        returned (a multi-task loss: their sum is minimised) or the model returned (loss_parts); {} for one loss."""
        if self.plain_classes(outputs, target):
            try:  # what _of_prediction computes for them, without its checks (they hold: the test above)
                loss = _cross_entropy(outputs, target, self.label_smoothing)
                return (loss if loss.dtype == torch.float32 else loss.float()), {}
            except (IndexError, RuntimeError):  # a target out of range: the whole way below says which
                pass
        prediction, model_loss = unpack_outputs(outputs)
        parts = {} if type(outputs) is torch.Tensor else loss_parts(outputs)
        if self.uses_model_loss(model_loss):
            loss = model_loss
        elif self.takes_outputs:
            loss = self.fn(outputs, target)
            if isinstance(loss, Mapping):  # named parts, {"cls": …, "reg": …}: their sum, each a column
                loss, parts = summed_losses(loss, f"loss_fn {self.name!r}")
        else:
            loss = self._of_prediction(prediction, target, outputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            source = "the model's own 'loss'" if self.uses_model_loss(model_loss) else f"loss_fn {self.name!r}"
            raise ValueError(
                f"{source} returned {_not_a_scalar(loss)}; the loss must be a scalar tensor: reduce it (e.g. .mean()), "
                "or use a loss function with reduction='mean'."
            )
        return (loss if loss.dtype == torch.float32 else loss.float()), parts

    def plain_classes(self, outputs, target) -> bool:
        """Whether this is the built-in cross-entropy of a prediction returned alone, classes last, with int64 class
        targets of its shape less that dimension ((B, C) for (B,), (B, T, V) for (B, T)), after the first batch's
        targets were checked: every batch of a classifier or a language model with a tensor out. Decided from types
        and shapes (no kernel), with none of the per-form tests `__call__` makes otherwise."""
        return (
            self.fn is None
            and not self.check_targets
            and type(outputs) is type(target) is torch.Tensor
            and target.dtype is torch.int64
            and outputs.dim() == target.dim() + 1
            and outputs.shape[:-1] == target.shape
            and outputs.is_floating_point()
        )

    def of_evaluation(self, outputs, target) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
        """The loss for evaluation and its named parts (`with_parts`); None where there is none to compute: outputs
        that are a list of dicts (a detector's detections: torchvision's compute their losses only in training mode),
        with no loss_fn of yours."""
        if is_list_of_dicts(outputs) and not self.takes_outputs:
            return None, {}
        return self.with_parts(outputs, target)

    def ignored_scalars(self, outputs) -> list[str]:
        """Where the outputs hold scalar tensors that this loss leaves out ("[1]", "['aux_loss']", ".aux_loss"): it is
        a built-in loss of the prediction alone (no loss_fn of yours, no loss of the model's own), and a tuple, dict
        or dataclass returned beside the prediction a scalar, such as a mixture of experts' load-balancing loss in
        (logits, aux_loss)."""
        prediction, model_loss = unpack_outputs(outputs)
        if self.takes_outputs or self.uses_model_loss(model_loss) or prediction is None:
            return []
        return [path for path, value in named_outputs(outputs) if value is not prediction and _is_scalar(value)]

    def _of_prediction(self, prediction, target, outputs) -> torch.Tensor:
        """A built-in loss (cross-entropy, mean squared error, PyTorch's) of the prediction and target."""
        if is_list_of_dicts(target):
            raise ValueError(
                f"the targets are {describe_value(target)}, one per example, as detection models take them, and the "
                f"model returned {describe_value(outputs)}: no losses. A detector computes its losses in training "
                "mode and returns them as a dict of scalar tensors (torchvision's do), which fit sums; or pass "
                "loss_fn=your function of (outputs, targets)."
            )
        if prediction is None:
            raise ValueError(
                f"the model returned {_describe(outputs)}: no prediction (a tensor, 'logits' or 'out') and no 'loss'. "
                "Pass loss_fn=your function of (outputs, target), which gets the outputs as returned, e.g. "
                "loss_fn=lambda outputs, target: F.cross_entropy(outputs['name'], target); or return 'loss'."
            )
        if target is None:
            raise ValueError(
                "the batch has no target and the model returned no 'loss': put the target in the batch "
                "((inputs, target), or a 'labels' entry of a dict batch), return 'loss' from the model, or pass "
                "loss_fn=your function of (outputs, target), which may ignore the target (None)."
            )
        if self.fn is not None and self.elementwise:
            _check_same_shape(prediction, target, self.name)
        if self.name != "cross_entropy":
            return self.fn(prediction, target)
        _check_classification(prediction, target)  # the kit's cross-entropy, or PyTorch's: check what it is given
        target = as_class_indices(target)
        self._check_range(prediction, target)
        try:
            if self.fn is None:
                return _cross_entropy(prediction, target, self.label_smoothing)  # checked above
            return self.fn(prediction, target)
        except torch.OutOfMemoryError:
            raise
        except (IndexError, RuntimeError) as error:  # a target out of range on a later batch than the first
            wrong = self._wrong_targets(prediction, target) if self.diagnoses else None
            if wrong is None:
                raise
            raise BatchError(wrong) from error

    def _check_range(self, prediction: torch.Tensor, target: torch.Tensor) -> None:
        """The first batch's targets against the number of classes (one synchronisation, once): on a GPU an
        out-of-range target is a device-side assert that ends the process, so it is refused before it is used."""
        if not self.check_targets:
            return
        self.check_targets = False
        self.classes = prediction.shape[-1] if prediction.shape[:-1] == target.shape else prediction.shape[1]
        wrong = self._wrong_targets(prediction, target)
        if wrong is not None:
            raise BatchError(wrong)

    def _wrong_targets(self, prediction: torch.Tensor, target: torch.Tensor) -> str | None:
        """What is wrong with these class targets for this prediction, in words; None if nothing is."""
        classes = prediction.shape[-1] if prediction.shape[:-1] == target.shape else prediction.shape[1]
        scored = target[target != self.ignore_index]
        if scored.numel() == 0:
            return (
                f"every one of its {target.numel()} targets equals {self.ignore_index} (ignored), so its loss is 0/0 = "
                "NaN, which would make the weights NaN: leave out examples without a scored target (e.g. padding "
                "only, or too short to predict a next token), or give each batch at least one."
            )
        low, high = torch.stack([scored.min(), scored.max()]).tolist()
        if low >= 0 and high < classes:
            return None
        if high >= classes:
            from_one = " (numbered from 1? subtract 1)" if low == 1 and high == classes else ""
            fix = f"fix the labels{from_one}, or give the model {high + 1} outputs"
        else:
            fix = "fix the negative labels"
        return (
            f"class targets must lie in 0..{classes - 1} (the outputs have {classes} classes), found {low}..{high}: "
            f"a label is out of range for the model's {classes} outputs: {fix} (targets equal to "
            f"{self.ignore_index} are ignored)."
        )

    def tracks_accuracy(self, batch: Batch, outputs) -> bool:
        """Whether accuracy means something for these outputs and target (see the module docstring).

        Decided once per pass over the data; where no built-in cross-entropy has checked the targets
        already, it reads whether they all are classes of the prediction: one synchronisation.
        """
        prediction, model_loss = unpack_outputs(outputs)
        target = batch.target
        if prediction is None or not isinstance(target, torch.Tensor) or not prediction.is_floating_point():
            return False  # (a target per task: your metrics measure each)
        if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
            return False
        dimension = class_dimension(prediction, target)
        if dimension is None or prediction.shape[dimension] < 2:
            return False
        if self.uses_model_loss(model_loss):
            if target.dim() > 1:
                return False  # a model's own loss over sequences may shift its labels: position t need not score t
        elif self.takes_outputs and isinstance(outputs, (tuple, list)):
            return False  # your loss may use a tuple's first tensor otherwise than as class scores (a VAE's recon)
        elif self.name == "cross_entropy":
            return True  # the kit's cross-entropy (or PyTorch's) scores it, and has checked the targets
        classes = prediction.shape[dimension]
        return bool(((target == self.ignore_index) | ((target >= 0) & (target < classes))).all())

    def shifts_labels(self, batch: Batch, outputs, loss: torch.Tensor | None) -> bool | None:
        """Whether `loss` (this batch's) scores the target shifted: labels[:, 1:] against the predictions at positions
        0..T-2, as a Hugging Face causal LM's own loss does. False for data that is no token sequence, and for a
        built-in loss (it scores the target as given). A model's own loss, or your loss_fn, is measured: compared
        with cross-entropy of the prediction (B, T, V) against the target as given and shifted (one synchronisation
        or two, once). Where it matches neither or both: None for the model's own loss (it cannot tell), False for
        your loss_fn (the target as given, the count documented for it)."""
        prediction, model_loss = unpack_outputs(outputs)
        own = self.uses_model_loss(model_loss)
        if not batch.is_sequence or loss is None or not (own or self.takes_outputs):
            return False
        target, unknown = batch.target, None if own else False
        if prediction is None or prediction.dim() != 3 or prediction.shape[:2] != target.shape or target.shape[1] < 2:
            return unknown
        classes, ignored = prediction.shape[-1], target == self.ignore_index
        if not bool((ignored | ((target >= 0) & (target < classes))).all()):  # an index out of range would assert
            return unknown
        with torch.no_grad():
            logits, target = prediction.detach().float(), as_class_indices(target)
            ignore = self.ignore_index
            as_given = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=ignore)
            shifted = F.cross_entropy(logits[:, :-1].flatten(0, 1), target[:, 1:].flatten(), ignore_index=ignore)
            value, as_given, shifted = torch.stack([loss.detach().float(), as_given, shifted]).tolist()
        tolerance = 1e-4 * max(1.0, abs(value))  # the same cross-entropy of the same logits: rounding apart
        matches_given, matches_shifted = abs(as_given - value) <= tolerance, abs(shifted - value) <= tolerance
        return unknown if matches_given == matches_shifted else matches_shifted

    def correct(self, prediction: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(correct, scored) predictions as 0-d tensors on the device: nothing waits for the GPU.

        A prediction is correct when the target's score is strictly higher than every other class's
        (a tie counts as wrong, so constant outputs never look right). Computed with a gather and a
        max rather than argmax: the same answer wherever the top score is unique, and several times
        cheaper on a CPU, where argmax over the last dimension is slow (1.6 ms against 0.6 ms for
        (32, 64, 256) logits, measured), which matters when it runs on every training batch.
        """
        target = as_class_indices(target)  # gather takes int64 indices
        if class_dimension(prediction, target) != prediction.dim() - 1:
            prediction = prediction.movedim(1, -1)  # classes in dimension 1 ((B, C, H, W)): move them last
        scored = target != self.ignore_index
        index = torch.where(scored, target, 0).unsqueeze(-1)  # ignored targets (-100) point at class 0
        score = prediction.gather(-1, index)  # (..., 1): the target's score
        others = prediction.scatter(-1, index, float("-inf")).amax(-1)  # the best of the other classes
        return ((score.squeeze(-1) > others) & scored).sum(), scored.sum()
