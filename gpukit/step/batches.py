"""Batch forms: what a loader yields, split into what the model is called with and what its output is compared to.

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
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_leaves, tree_map

from .outputs import _describe, is_list_of_dicts

IGNORE_INDEX = -100  # targets equal to this are not scored (PyTorch's and Hugging Face's convention)
BATCH_FORMS = (
    "(inputs, target) with inputs a tensor, a tuple/list of tensors or a dict of tensors; "
    "(*inputs, target) with three or more tensors; a dict of tensors passed as model(**batch), "
    "whose 'labels' entry is the target; or (images, targets) with targets a list of dicts, one per example "
    "(torchvision's detection form), passed as model(images, targets); or an object with a .to(device) method "
    "that returns it moved (torch_geometric's DataBatch), passed whole as model(batch), whose .y is the target"
)


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
