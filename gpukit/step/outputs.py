"""What a model returned: its prediction, its own loss and the losses it names; and any value, in words.

The model may return anything: a tensor, a tuple or list (a VAE's (recon, mu, logvar)), a dict
(torchvision's segmentation models return {"out": …, "aux": …}), a dataclass (read as the dict of
its fields) or an object with attributes (a Hugging Face ModelOutput). Its *prediction*, found by `unpack_outputs` (the one place that looks
inside outputs), is the tensor itself; a dict's or object's `logits`, else its `out`; or the first
tensor of a tuple or list. Its own loss is a dict's or object's `loss`, or the sum of a dict of
scalar tensors (a torchvision detector's losses in training mode, {"loss_classifier": …, …}):
fit and evaluate then report each of them too, as a column of its own (`loss_parts`). A list of
dicts (a detector's detections in eval mode) holds neither: evaluate reports your metrics of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch


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
