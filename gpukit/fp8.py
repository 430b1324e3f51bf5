"""FP8 numerics, measurable on any machine: what 8-bit floats do to a model's weights, activations and gradients.

Two 8-bit formats (OCP FP8, on H100, H200, B200 and newer): e4m3 (4 exponent bits, 3 mantissa bits:
largest 448, relative step 2^-3) for weights and activations, and e5m2 (5 and 2: largest 57,344, relative
step 2^-2) for gradients, whose range is wider. Either range is far narrower than bf16's, so each tensor is
multiplied by a *scale* before the cast: per-tensor scaling maps the tensor's largest magnitude (amax) to
the format's largest value, and the matmul divides it out again. Without a scale, small values (gradients
of 1e-6) fall below the smallest FP8 number and become zero.

`numerics(model, batch)` runs one training step, captures every Linear layer's weight, input and output
gradient, and measures the relative error of each cast (bf16, e4m3 and e5m2 with a per-tensor scale, and
e4m3 without one) against the fp32 values. The speed of FP8 training needs a GPU with FP8 tensor cores
and torchao (`convert_to_float8_training`): `convert` calls it where it is installed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn

from .report import Table
from .step import Loss, split_batch

__all__ = ["FORMATS", "Numerics", "TensorErrors", "convert", "dequantize", "numerics", "quantize", "relative_error"]

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


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def convert(model: nn.Module) -> nn.Module:
    """torchao's FP8 training (tensorwise scaling) for `model`'s Linear layers, in place: needs torchao and a
    GPU with FP8 tensor cores (compute capability 8.9 or newer), and pays off with torch.compile on large
    matmuls only (torchao measured 0.80x for M, K, N = 1024, 2048, 1024 on an H100)."""
    if not torchao_available():
        raise ImportError("FP8 training uses torchao: pip install torchao (a version matching your torch).")
    from torchao.float8 import convert_to_float8_training  # an optional dependency

    return convert_to_float8_training(model)
