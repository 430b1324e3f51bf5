"""One training step on one batch, for any model and any batch form.

`fit`, `evaluate`, `gk.memory`, `gk.bench`, `gk.distributed.scaling` and the benchmarks all run
this one definition, so what is measured is what is trained.

A *batch* is what a loader yields. Accepted forms:

    (inputs, target)       inputs a tensor → model(inputs); a tuple or list of tensors →
                           model(*inputs) (the default collate turns a Dataset's ((a, b), y)
                           into lists); a dict → model(**inputs)
    (*inputs, target)      three or more tensors, as TensorDataset(a, b, y) yields
    {"name": tensor, …}    a dict (the Hugging Face convention) → model(**batch); its "labels"
                           entry, if any, is the target
    (inputs, targets)      targets a list (or tuple) of dicts, one per example: torchvision's
                           detection form, images a list of (C, H, W) tensors and targets
                           [{"boxes": (N, 4), "labels": (N,)}, …] → model(inputs, targets), as you
                           would call it: such a model takes its targets and computes its own losses
    an object that moves itself  with a .to(device) method that returns it moved, such as
                           torch_geometric's DataBatch → model(batch), passed whole; its `y`, if a
                           tensor, is the target

Every tensor is moved to the device, inside lists, tuples and dicts too, element by element; an
object that moves itself is moved by its own .to(device). Samples are counted by the target's first
dimension where there is a target (8 graphs, not their 300 nodes), else by the first tensor's.

The model may return anything: a tensor, a tuple or list (a VAE's (recon, mu, logvar)), a dict
(torchvision's segmentation models return {"out": …, "aux": …}), a dataclass (read as the dict of
its fields) or an object with attributes (a Hugging Face ModelOutput). Its *prediction*, found by `unpack_outputs` (the one place that looks
inside outputs), is the tensor itself; a dict's or object's `logits`, else its `out`; or the first
tensor of a tuple or list. Its own loss is a dict's or object's `loss`, or the sum of a dict of
scalar tensors (a torchvision detector's losses in training mode, {"loss_classifier": …, …}):
fit and evaluate then report each of them too, as a column of its own (`loss_parts`). A list of
dicts (a detector's detections in eval mode) holds neither: evaluate reports your metrics of it.

The loss is, in this order:
- `loss_fn(outputs, target)` with your own function: it receives the outputs exactly as the model
  returned them (the whole tuple or dict), and the target (None for a dict batch without "labels");
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

import contextlib
import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils._pytree import tree_leaves, tree_map

from .precision import Precision, get_precision

__all__ = [
    "IGNORE_INDEX",
    "LOSSES",
    "Batch",
    "BatchError",
    "Loss",
    "TrainStep",
    "cross_entropy",
    "describe_value",
    "forward_backward",
    "is_list_of_dicts",
    "loss_parts",
    "mean_squared_error",
    "named_outputs",
    "only_losses",
    "split_batch",
    "to_device",
    "training_mode",
    "unpack_outputs",
]

IGNORE_INDEX = -100  # targets equal to this are not scored (PyTorch's and Hugging Face's convention)
LOSSES = ("cross_entropy", "mse")
BATCH_FORMS = (
    "(inputs, target) with inputs a tensor, a tuple/list of tensors or a dict of tensors; "
    "(*inputs, target) with three or more tensors; a dict of tensors passed as model(**batch), "
    "whose 'labels' entry is the target; or (images, targets) with targets a list of dicts, one per example "
    "(torchvision's detection form), passed as model(images, targets); or an object with a .to(device) method "
    "that returns it moved (torch_geometric's DataBatch), passed whole as model(batch), whose .y is the target"
)


# ---------------------------------------------------------------------------------------------
# Batches


class BatchError(ValueError):
    """A batch that cannot be trained on, for a reason read from its own data (targets out of range, every target
    ignored, no samples); fit puts the batch's number in front of the message."""


@dataclass
class Batch:
    """A batch split into what the model is called with and what its output is compared to.

    size:  examples in the batch (the first dimension of its target, else of its first tensor; in the
           detection form, the number of per-example targets).
    target_to_model: the model is called with the target as its last argument, model(*args, target):
           the detection form, whose model computes its own losses from its targets.
    moves_itself: args is one object that moves itself (.to(device)), such as torch_geometric's DataBatch.
    """

    args: tuple
    kwargs: dict
    target: torch.Tensor | list | None
    size: int
    target_to_model: bool = False
    moves_itself: bool = False
    _scored_tokens: tuple[bool, torch.Tensor] | None = dataclasses.field(
        default=None, init=False, repr=False, compare=False
    )

    def call(self, model: Callable):
        if self.target_to_model:
            return model(*self.args, self.target, **self.kwargs)
        return model(*self.args, **self.kwargs)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the batch, inside lists, tuples and dicts too (and an object's that moves itself)."""
        if self.moves_itself:
            return [value for value in _attributes(self.args[0]).values() if isinstance(value, torch.Tensor)]
        return [t for t in tree_leaves((self.args, self.kwargs, self.target)) if isinstance(t, torch.Tensor)]

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> Batch:
        """The same batch with `fn` applied to every tensor in it, inside lists, tuples and dicts too. An object
        that moves itself is mapped by its own `apply` (torch_geometric's), on a copy; without one it is kept."""
        if self.moves_itself:
            carrier = self.args[0]
            return split_batch(copy.copy(carrier).apply(fn) if callable(getattr(carrier, "apply", None)) else carrier)
        args, kwargs, target = tree_map(
            lambda x: fn(x) if isinstance(x, torch.Tensor) else x, (self.args, self.kwargs, self.target)
        )
        return dataclasses.replace(self, args=args, kwargs=kwargs, target=target)

    def repeated(self, batch_size: int) -> Batch:
        """The batch's examples taken in turn until there are `batch_size`: every tensor whose first dimension
        is the batch's, and every list or tuple of one item per example (a detection batch's images and targets).
        Real values, unlike zeros: a detector's boxes stay boxes."""
        index = [i % self.size for i in range(batch_size)]

        def per_example(value):
            if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == self.size:
                return value[torch.tensor(index, device=value.device)]
            if isinstance(value, (tuple, list)) and len(value) == self.size:
                return type(value)(value[i] for i in index)
            return value

        return dataclasses.replace(
            self,
            args=tuple(per_example(x) for x in self.args),
            kwargs={key: per_example(x) for key, x in self.kwargs.items()},
            target=per_example(self.target),
            size=batch_size,
        )

    @property
    def is_images(self) -> bool:
        """One floating-point input of images: a (B, C, H, W) batch, or a list of (C, H, W) images (detection)."""
        only = self.args[0] if len(self.args) == 1 and not self.kwargs else None
        if isinstance(only, (tuple, list)) and only:
            return all(isinstance(x, torch.Tensor) and x.dim() == 3 and x.is_floating_point() for x in only)
        return isinstance(only, torch.Tensor) and only.dim() == 4 and only.is_floating_point()

    @property
    def is_sequence(self) -> bool:
        """An integer target (B, T): samples are sequences of tokens. A segmentation's (B, H, W) target is not:
        its samples are images, and its pixels are not counted as tokens."""
        target = self.target
        return isinstance(target, torch.Tensor) and not target.is_floating_point() and target.dim() == 2

    @property
    def sample_name(self) -> str:
        """What one example is: "image", "sequence" or "sample"."""
        return "image" if self.is_images else "sequence" if self.is_sequence else "sample"

    def count_tokens(self, shifted_labels: bool = False) -> torch.Tensor | None:
        """Scored target tokens (not IGNORE_INDEX), as a 0-d tensor on the device; None if not a sequence.
        `shifted_labels`: the loss scores labels[:, 1:] (a causal LM that shifts its labels inside, as Hugging
        Face's do: T - 1 tokens a sequence), so the first position's label is not counted. Counted once per batch:
        fit's epoch and its log window both ask (two kernels)."""
        if not self.is_sequence:
            return None
        if self._scored_tokens is None or self._scored_tokens[0] != shifted_labels:
            target = self.target[:, 1:] if shifted_labels else self.target
            self._scored_tokens = (shifted_labels, (target != IGNORE_INDEX).sum())
        return self._scored_tokens[1]


def _attributes(value) -> dict:
    """An object's attributes by name: torch_geometric's to_dict(), else its __dict__."""
    to_dict = getattr(value, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else dict(getattr(value, "__dict__", {}))


def _moves_itself(value) -> bool:
    """An object batch that moves itself to a device (.to(device)): not a tensor, dict, list or tuple."""
    return not isinstance(value, (torch.Tensor, Mapping, tuple, list)) and callable(getattr(value, "to", None))


def _leaves(value) -> list:
    if isinstance(value, Mapping):
        return list(value.values())
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value]


def _describe(value) -> str:
    """A short description of a batch for error messages: types and shapes, not values."""
    if isinstance(value, torch.Tensor):
        return f"tensor{tuple(value.shape)}"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{key!r}: {_describe(item)}" for key, item in list(value.items())[:6]) + "}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(_describe(item) for item in value[:6]) + (", …" if len(value) > 6 else "")
        return ("(" if isinstance(value, tuple) else "[") + inner + (")" if isinstance(value, tuple) else "]")
    return type(value).__name__


def describe_value(value) -> str:
    """What a value is, in words, for messages: "a list of 2 dicts ('boxes', 'labels', 'scores')", "a tuple of 2
    tensors of shapes (8, 10), ()", "a tuple of a tensor of shape (8, 10) and a dict with keys 'aux'"."""
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    if is_list_of_dicts(value):
        keys = list(dict.fromkeys(key for item in value for key in item))
        return f"a {type(value).__name__} of {len(value)} dicts ({', '.join(map(repr, keys[:8]))})"
    if isinstance(value, (tuple, list)):
        kind = type(value).__name__
        if not value:
            return f"an empty {kind}"
        if len(value) > 1 and all(isinstance(item, torch.Tensor) for item in value):  # a detection batch's images
            shapes = ", ".join(str(tuple(item.shape)) for item in value[:4]) + (", …" if len(value) > 4 else "")
            return f"a {kind} of {len(value)} tensors of shapes {shapes}"
        items = [describe_value(item) for item in value[:4]] + (["…"] if len(value) > 4 else [])
        return f"a {kind} of " + (items[0] if len(items) == 1 else f"{', '.join(items[:-1])} and {items[-1]}")
    if isinstance(value, Mapping):
        return f"a dict with keys {', '.join(map(repr, list(value)[:8]))}"
    fields = _fields(value)
    if fields is not None:
        return f"a dataclass {type(value).__name__} with fields {', '.join(map(repr, list(fields)[:8]))}"
    return f"a {type(value).__name__}"


def is_list_of_dicts(value) -> bool:
    """A non-empty list or tuple of dicts: one per example (detection targets, or a detector's detections)."""
    return isinstance(value, (tuple, list)) and bool(value) and all(isinstance(item, Mapping) for item in value)


def _first_dimension(value) -> int | None:
    for leaf in _leaves(value):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return leaf.shape[0]
        if isinstance(leaf, (tuple, list, Mapping)):
            found = _first_dimension(leaf)
            if found is not None:
                return found
    return None


def split_batch(batch) -> Batch:
    """Split a batch of any accepted form (see the module docstring) into inputs and target."""
    if isinstance(batch, Batch):
        return batch
    if _moves_itself(batch):  # torch_geometric's DataBatch: model(batch), its .y the target
        target = getattr(batch, "y", None)
        target = target if isinstance(target, torch.Tensor) else None
        size = target.shape[0] if target is not None and target.dim() else getattr(batch, "num_graphs", None)
        if not isinstance(size, int):
            raise TypeError(
                f"the batch is a {type(batch).__name__} without a target to count its samples by: give it a tensor "
                "`y` (one row per sample) or an int `num_graphs`, or yield (inputs, target) tuples."
            )
        return Batch((batch,), {}, target, size, moves_itself=True)
    if isinstance(batch, Mapping):
        if not any(isinstance(value, torch.Tensor) for value in batch.values()):
            raise TypeError(
                f"the batch is a dict without tensors ({_describe(batch)}); the accepted forms are {BATCH_FORMS}."
            )
        target = batch.get("labels")
        target = target if isinstance(target, torch.Tensor) else None
        return Batch((), dict(batch), target, _size(batch, target))
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        *inputs, target = batch
        if is_list_of_dicts(target) and len(inputs) == 1:  # detection: model(images, targets)
            return Batch((inputs[0],), {}, target, len(target), target_to_model=True)
        if not isinstance(target, torch.Tensor):
            raise TypeError(
                f"the last element of a batch must be the target: a tensor, or a list of dicts (one per example), "
                f"got {_describe(batch)}; the accepted forms are {BATCH_FORMS}.{_collate_hint(target)}"
            )
        if len(inputs) == 1:
            (inputs,) = inputs
            if isinstance(inputs, torch.Tensor):
                return Batch((inputs,), {}, target, _size(batch, target))
            if isinstance(inputs, Mapping):
                return Batch((), dict(inputs), target, _size(batch, target))
            if isinstance(inputs, (tuple, list)) and inputs and all(isinstance(x, torch.Tensor) for x in inputs):
                return Batch(tuple(inputs), {}, target, _size(batch, target))
        elif all(isinstance(x, torch.Tensor) for x in inputs):
            return Batch(tuple(inputs), {}, target, _size(batch, target))
    hint = ""
    if not isinstance(batch, (torch.Tensor, Mapping, tuple, list)):  # an object batch that cannot move itself
        hint = (
            f" A {type(batch).__name__} is passed whole as model(batch) once it has a .to(device) method that returns "
            "it moved and its target as .y; or yield (inputs, target) tuples (a DataLoader's collate_fn can build them)."
        )
    raise TypeError(f"cannot use a batch of the form {_describe(batch)}; the accepted forms are {BATCH_FORMS}.{hint}")


def _collate_hint(target) -> str:
    """A dict of batched tensors where per-example dicts were meant: what PyTorch's default collate makes of them."""
    if not isinstance(target, Mapping):
        return ""
    return (
        " A dict target is what the DataLoader's default collate makes of per-example dicts (it stacks them, and "
        "fails on boxes of different counts): keep one dict per example with "
        "DataLoader(..., collate_fn=gk.data.collate_lists)."
    )


def _size(batch, target: torch.Tensor | None = None) -> int:
    """Samples: the target's first dimension (a graph batch's 8 graphs, not its 300 nodes), else the first tensor's."""
    if target is not None and target.dim():
        return target.shape[0]
    size = _first_dimension(batch)
    if size is None:
        raise TypeError(
            f"the batch {_describe(batch)} has no tensor with a batch dimension; the accepted forms are {BATCH_FORMS}."
        )
    return size


def to_device(batch: Batch, device: torch.device) -> Batch:
    """Every tensor of the batch on `device`; non-blocking, so a copy from pinned memory overlaps compute. An object
    that moves itself is moved by its own .to(device)."""
    if batch.moves_itself:
        return split_batch(batch.args[0].to(device))
    return batch.map(lambda tensor: tensor.to(device, non_blocking=True))


# ---------------------------------------------------------------------------------------------
# Model outputs


def unpack_outputs(outputs) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(prediction, the model's own loss) in what a model returned, each None where there is none
    (see the module docstring)."""
    if isinstance(outputs, torch.Tensor):
        return outputs, None
    if isinstance(outputs, (tuple, list)):
        return next((item for item in outputs if isinstance(item, torch.Tensor)), None), None
    fields = _fields(outputs)
    if fields is not None:  # a dict, a Hugging Face ModelOutput (an OrderedDict), a dataclass
        losses = _dict_of_losses(fields)
        if losses and "loss" not in losses:  # a detector's {"loss_classifier": …, "loss_box_reg": …}
            return None, sum(losses.values())
        found = fields.get("logits"), fields.get("out"), fields.get("loss")
    else:
        found = (getattr(outputs, name, None) for name in ("logits", "out", "loss"))
    logits, out, loss = (value if isinstance(value, torch.Tensor) else None for value in found)
    return (logits if logits is not None else out), loss


def _fields(outputs) -> Mapping | None:
    """Outputs read by name: a dict or ModelOutput as it is, a dataclass as the dict of its fields; else None."""
    if isinstance(outputs, Mapping):
        return outputs
    if dataclasses.is_dataclass(outputs) and not isinstance(outputs, type):
        return {field.name: getattr(outputs, field.name) for field in dataclasses.fields(outputs)}
    return None


def named_outputs(outputs) -> list[tuple[str, object]]:
    """The parts of a tuple, list, dict or dataclass the model returned, each with how to read it from `outputs`:
    "[1]", "['aux_loss']", ".aux_loss"; empty for other outputs."""
    if isinstance(outputs, (tuple, list)):
        return [(f"[{index}]", value) for index, value in enumerate(outputs)]
    if isinstance(outputs, Mapping):
        return [(f"[{key!r}]", value) for key, value in outputs.items()]
    return [(f".{name}", value) for name, value in (_fields(outputs) or {}).items()]


def _is_scalar(value) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 0 and value.is_floating_point()


def _dict_of_losses(outputs) -> dict[str, torch.Tensor]:
    """A dict (or dataclass) whose every value is a scalar floating-point tensor: the model's losses; else empty."""
    if isinstance(outputs, torch.Tensor):  # the common case, asked three times a step: no dataclass inspection
        return {}
    fields = _fields(outputs)
    if fields and all(_is_scalar(value) for value in fields.values()):
        return dict(fields)
    return {}


def only_losses(outputs) -> bool:
    """Whether the outputs are a dict of losses and nothing else (a detector in training mode): no prediction
    for a metric to measure."""
    return bool(_dict_of_losses(outputs))


def loss_parts(outputs) -> dict[str, torch.Tensor]:
    """The losses a model returned as a dict of scalars, detached, by column name (a name that does not start
    with "loss" gets "loss_" in front, so that no part is taken for another column); not its total "loss"."""
    return {
        (name if str(name).startswith("loss") else f"loss_{name}"): value.detach()
        for name, value in _dict_of_losses(outputs).items()
        if name != "loss"
    }


def class_dimension(prediction: torch.Tensor, target: torch.Tensor) -> int | None:
    """The dimension of `prediction` that holds the classes of `target`: the last ((B, C) for (B,),
    (B, T, V) for (B, T)) or the second ((B, C, H, W) for (B, H, W)); None if neither fits."""
    if prediction.dim() != target.dim() + 1:
        return None
    if prediction.shape[:-1] == target.shape:
        return prediction.dim() - 1
    if prediction.shape[:1] + prediction.shape[2:] == target.shape:
        return 1
    return None


# ---------------------------------------------------------------------------------------------
# Losses


def cross_entropy(prediction: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy over scored targets, classes in the last dimension of `prediction`.

    (B, C) with (B,), (B, T, V) with (B, T); also PyTorch's own layout with classes in dimension 1
    ((B, C, H, W) with (B, H, W)). Targets equal to IGNORE_INDEX (-100) are not scored.
    """
    _check_classification(prediction, target)
    return _cross_entropy(prediction, as_class_indices(target), label_smoothing)


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

    def __init__(
        self, loss_fn: str | Callable | None = None, label_smoothing: float = 0.0, *, check_targets: bool = True
    ):
        if not 0 <= label_smoothing < 1:
            raise ValueError(f"label_smoothing must lie in [0, 1), got {label_smoothing!r}.")
        self.label_smoothing = label_smoothing
        self.ignore_index = IGNORE_INDEX
        # Class targets are checked against the number of outputs once, on the first batch (one
        # synchronisation): on a GPU an out-of-range target is a device-side assert that ends the process.
        self.check_targets = check_targets
        self.diagnoses = check_targets  # read the targets when the loss fails (not on the meta device or fake ones)
        self.classes: int | None = None  # the prediction's classes, once the first batch's targets were checked
        self.takes_outputs = False
        if loss_fn is None or loss_fn == "cross_entropy" or loss_fn is F.cross_entropy:
            self.name, self.fn, self.explicit = "cross_entropy", None, loss_fn is not None
        elif loss_fn == "mse":
            self.name, self.fn, self.explicit = "mse", mean_squared_error, True
        elif isinstance(loss_fn, str):
            raise ValueError(
                f"loss_fn={loss_fn!r} is unknown; use one of {', '.join(map(repr, LOSSES))} or a function."
            )
        elif callable(loss_fn):
            self.name, self.fn, self.explicit = getattr(loss_fn, "__name__", type(loss_fn).__name__), loss_fn, True
            self.takes_outputs = not _takes_a_tensor(loss_fn)
            if isinstance(loss_fn, nn.CrossEntropyLoss):
                self.name, self.ignore_index = "cross_entropy", loss_fn.ignore_index
        else:
            raise TypeError(f"loss_fn must be a function, 'cross_entropy' or 'mse', got {type(loss_fn).__name__}.")
        if label_smoothing and (self.name != "cross_entropy" or self.fn is not None):
            raise ValueError(
                "label_smoothing applies to the built-in cross-entropy (loss_fn=None or 'cross_entropy'); build it "
                "into your own loss_fn instead, e.g. nn.CrossEntropyLoss(label_smoothing=0.1)."
            )
        self.elementwise = loss_fn in _ELEMENTWISE_FUNCTIONS or isinstance(loss_fn, _ELEMENTWISE_MODULES)

    def __repr__(self) -> str:
        return f"Loss({self.name!r})"

    def uses_model_loss(self, model_loss) -> bool:
        return model_loss is not None and not self.explicit

    def __call__(self, outputs, target) -> torch.Tensor:
        """The scalar loss (float32) of one batch from what the model returned and the batch's target."""
        if self.plain_classes(outputs, target):
            try:  # what _of_prediction computes for them, without its checks (they hold: the test above)
                loss = _cross_entropy(outputs, target, self.label_smoothing)
                return loss if loss.dtype == torch.float32 else loss.float()
            except (IndexError, RuntimeError):  # a target out of range: the whole way below says which
                pass
        prediction, model_loss = unpack_outputs(outputs)
        if self.uses_model_loss(model_loss):
            loss = model_loss
        elif self.takes_outputs:
            loss = self.fn(outputs, target)
        else:
            loss = self._of_prediction(prediction, target, outputs)
        if not isinstance(loss, torch.Tensor) or loss.dim() != 0:
            source = "the model's own 'loss'" if self.uses_model_loss(model_loss) else f"loss_fn {self.name!r}"
            raise ValueError(
                f"{source} returned {_not_a_scalar(loss)}; the loss must be a scalar tensor: reduce it (e.g. .mean()), "
                "or use a loss function with reduction='mean'."
            )
        return loss if loss.dtype == torch.float32 else loss.float()

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

    def of_evaluation(self, outputs, target) -> torch.Tensor | None:
        """The loss for evaluation; None where there is none to compute: outputs that are a list of dicts (a
        detector's detections: torchvision's compute their losses only in training mode), with no loss_fn of yours."""
        if is_list_of_dicts(outputs) and not self.takes_outputs:
            return None
        return self(outputs, target)

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
        if prediction is None or target is None or not prediction.is_floating_point():
            return False
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


# ---------------------------------------------------------------------------------------------
# The step


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
