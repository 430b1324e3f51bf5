"""What casting to 8-bit floats does to a tensor, and to a model's weights, activations and gradients.

`quantize` casts a tensor to e4m3 or e5m2 with a per-tensor scale (its amax mapped to the format's largest value),
`dequantize` undoes it, `relative_error` measures the loss against fp32; `numerics(model, batch)` measures it for
every Linear layer's weight, input and output gradient over one training step. Runs on any machine.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..report import Table
from ..step import Loss, split_batch

FORMATS = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


def _format(name: str) -> torch.dtype:
    if name not in FORMATS:
        raise ValueError(f"unknown FP8 format {name!r}; use one of {', '.join(map(repr, FORMATS))}.")
    return FORMATS[name]


def quantize(tensor: torch.Tensor, format: str = "e4m3", *, scaled: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(the FP8 tensor, its scale): `tensor` × scale cast to FP8, the scale mapping its amax to the format's
    largest value (1 when `scaled` is False). Values beyond the range saturate instead of becoming inf."""
    dtype = _format(format)
    largest = torch.finfo(dtype).max
    tensor = tensor.detach().float()
    if scaled:
        amax = tensor.abs().max().clamp(min=1e-12)  # an all-zero tensor keeps a finite scale
        scale = largest / amax
    else:
        scale = torch.ones((), device=tensor.device)
    return (tensor * scale).clamp(-largest, largest).to(dtype), scale


def dequantize(fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return fp8.float() / scale


def relative_error(tensor: torch.Tensor, format: str = "e4m3", *, scaled: bool = True) -> float:
    """‖cast(tensor) − tensor‖ / ‖tensor‖ in fp32, for format "bf16" or an FP8 format (scaled or not)."""
    reference = tensor.detach().float()
    if format == "bf16":
        rounded = reference.bfloat16().float()
    else:
        rounded = dequantize(*quantize(reference, format, scaled=scaled))
    norm = reference.norm()
    return float((rounded - reference).norm() / norm) if norm > 0 else 0.0


@dataclass
class TensorErrors:
    """The relative error of each cast of one kind of tensor (weights, activations or gradients),
    as the median over the model's Linear layers."""

    kind: str
    layers: int
    bf16: float
    e4m3: float
    e5m2: float
    e4m3_unscaled: float

    def row(self) -> dict:
        """One table row, errors in percent."""
        return {
            "tensor": self.kind,
            "layers": self.layers,
            "bf16 (%)": 100 * self.bf16,
            "e4m3 scaled (%)": 100 * self.e4m3,
            "e5m2 scaled (%)": 100 * self.e5m2,
            "e4m3 unscaled (%)": 100 * self.e4m3_unscaled,
        }


def _capture(model: nn.Module, batch, loss_fn) -> dict[str, list[torch.Tensor]]:
    """Every Linear layer's weight, input and output gradient over one forward and backward."""
    captured = {"weights": [], "activations": [], "gradients": []}

    def forward_hook(module, inputs, output):
        captured["activations"].append(inputs[0].detach())

    def backward_hook(module, grad_input, grad_output):
        captured["gradients"].append(grad_output[0].detach())

    layers = [module for module in model.modules() if isinstance(module, nn.Linear)]
    if not layers:
        raise ValueError(f"{type(model).__name__} has no nn.Linear layer: FP8 training converts Linear layers.")
    handles = [layer.register_forward_hook(forward_hook) for layer in layers]
    handles += [layer.register_full_backward_hook(backward_hook) for layer in layers]
    try:
        batch = split_batch(batch)
        outputs = batch.call(model)
        Loss(loss_fn)(outputs, batch.target).backward()
    finally:
        for handle in handles:
            handle.remove()
    model.zero_grad(set_to_none=True)
    captured["weights"] = [layer.weight.detach() for layer in layers]
    return captured


@dataclass
class Numerics:
    """What numerics() measured: errors[kind] for "weights", "activations" and "gradients"."""

    errors: dict[str, TensorErrors]

    def __getitem__(self, kind: str) -> TensorErrors:
        return self.errors[kind]

    def table(self) -> Table:
        return Table(
            [errors.row() for errors in self.errors.values()],
            title="relative error of each cast against fp32 (median over Linear layers)",
        )


def numerics(model: nn.Module, batch, *, loss_fn=None) -> Numerics:
    """One training step of `model` on `batch` (any form fit takes), in fp32: the relative error of casting
    its Linear layers' weights, activations (their inputs) and gradients (of their outputs) to bf16 and to
    FP8 (medians over layers). The model's gradients are left as they were before (None)."""
    was_training = model.training
    model.train()
    try:
        captured = _capture(model, batch, loss_fn)
    finally:
        model.train(was_training)
    casts = (("bf16", "bf16", True), ("e4m3", "e4m3", True), ("e5m2", "e5m2", True), ("e4m3_unscaled", "e4m3", False))
    errors = {}
    for kind, tensors in captured.items():
        medians = {
            name: torch.tensor([relative_error(t, fmt, scaled=scaled) for t in tensors]).median().item()
            for name, fmt, scaled in casts
        }
        errors[kind] = TensorErrors(kind, len(tensors), **medians)
    return Numerics(errors)
