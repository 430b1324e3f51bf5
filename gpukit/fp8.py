"""FP8 numerics, measurable on any machine: what 8-bit floats do to a model's weights, activations and gradients.

Two 8-bit formats (OCP FP8, on H100, H200, B200 and newer): e4m3 (4 exponent bits, 3 mantissa bits:
largest 448, relative step 2^-3) for weights and activations, and e5m2 (5 and 2: largest 57,344, relative
step 2^-2) for gradients, whose range is wider. Either range is far narrower than bf16's, so each tensor is
multiplied by a *scale* before the cast: per-tensor scaling maps the tensor's largest magnitude (amax) to
the format's largest value, and the matmul divides it out again. Without a scale, small values (gradients
of 1e-6) fall below the smallest FP8 number and become zero.

`numerics(model, batch)` runs one training step, captures every Linear layer's weight, input and output
gradient, and measures the relative error of each cast (bf16, e4m3 and e5m2 with a per-tensor scale, and
e4m3 without one) against the fp32 values.

FP8 *training* needs a GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, H100, H200, B200)
and torchao (the `fp8` extra: pip install 'gpukit[fp8]'). `convert(model)` swaps each plain nn.Linear whose
dimensions are multiples of 16 for torchao's Float8Linear (`convert_to_float8_training` with `linear_filter`
as its module_filter_fn; tensorwise scales), in place, and `unconvert` swaps them back; `fit(..., fp8=True)`
does both around training, converting before it compiles. `compare_speed` times a Linear layer's training
step in FP8 and bf16, compiled and not, at a small and a large shape: FP8 pays only on large matmuls, compiled.
On a machine without FP8 tensor cores, torchao's `Float8LinearConfig(emulate=True)` runs the same casts with
fp32 matmuls: the numerics of FP8 training, slowly (what the tests on a CPU use).
"""

from __future__ import annotations

import copy
import importlib.metadata
import importlib.util
import sys
from dataclasses import dataclass

import torch
from torch import nn

from .bench import Timing, compare
from .report import Table
from .step import Loss, split_batch

__all__ = [
    "FORMATS",
    "MIN_COMPUTE_CAPABILITY",
    "SPEED_SHAPES",
    "TORCHAO_REQUIREMENT",
    "Numerics",
    "Speed",
    "TensorErrors",
    "compare_speed",
    "convert",
    "convertible",
    "dequantize",
    "linear_filter",
    "numerics",
    "quantize",
    "relative_error",
    "supported",
    "torchao_available",
    "training_config",
    "unconvert",
]

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


# ---------------------------------------------------------------------------------------------
# FP8 training with torchao

MIN_COMPUTE_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (L4, L40S), Hopper (H100, H200), Blackwell (B200)
# 0.18 is the first torchao that works around a Triton miscompile of compiled FP8 kernels under torch 2.14 (NaNs in
# the backward); its float8 training runs on torch 2.11 to 2.14 (checked in emulation on a CPU with both).
TORCHAO_REQUIREMENT = "torchao>=0.18"
_TORCHAO_MISSING = f"torchao is not installed: pip install 'gpukit[fp8]' (or '{TORCHAO_REQUIREMENT}')"


def torchao_available() -> bool:
    return importlib.util.find_spec("torchao") is not None


def _hardware_reason(device: torch.device) -> str | None:
    """Why `device` has no FP8 matmuls, or None where it has them."""
    if device.type != "cuda":
        return (
            "FP8 matmuls need an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: L4, L40S, "
            f"H100, H200, B200), and this runs on {device.type}"
        )
    if not torch.cuda.is_available():  # asked for CUDA where this torch sees none (a Mac's torch has no CUDA)
        return f"FP8 matmuls need an NVIDIA GPU with FP8 tensor cores, and this torch sees no CUDA GPU for {device}"
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_COMPUTE_CAPABILITY:
        return (
            f"FP8 matmuls need FP8 tensor cores (compute capability 8.9 or newer); {torch.cuda.get_device_name(device)} "
            f"has {capability[0]}.{capability[1]}"
        )
    return None


def supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether FP8 training can run on `device` (FP8 tensor cores and torchao), and why or why not."""
    device = torch.device(device)
    reason = _hardware_reason(device) or (None if torchao_available() else _TORCHAO_MISSING)
    if reason is not None:
        return False, reason
    capability = torch.cuda.get_device_capability(device)
    return True, f"FP8 tensor cores (compute capability {capability[0]}.{capability[1]}) and torchao " + (
        importlib.metadata.version("torchao")
    )


def training_config(fp8, device: torch.device | str):
    """fit's `fp8` argument as torchao's Float8LinearConfig (None for False), checked before any work: True is
    torchao's default recipe (dynamic tensorwise scales), a Float8LinearConfig is used as given, and one with
    emulate=True runs on any device (fp32 matmuls of the FP8 values: the numerics, slowly)."""
    if fp8 is False:
        return None
    device = torch.device(device)
    if fp8 is True:
        reason = _hardware_reason(device)
        if reason is not None:
            raise ValueError(
                f"FP8 training runs the Linear layers' matmuls in FP8, but {reason}. Train without fp8 (with "
                "precision='bf16-mixed' on a GPU), or pass Float8LinearConfig(emulate=True) (from torchao.float8) "
                "as fp8 to check FP8's numerics, slowly, on any device."
            )
        if not torchao_available():
            raise ImportError(f"FP8 training swaps the Linear layers for torchao's, but {_TORCHAO_MISSING}.")
    elif not torchao_available():
        raise TypeError(f"fp8 must be True, False or a torchao.float8.Float8LinearConfig, got {fp8!r}.")
    from torchao.float8 import Float8LinearConfig  # an optional dependency: the fp8 extra

    if fp8 is True:
        return Float8LinearConfig()
    if not isinstance(fp8, Float8LinearConfig):
        raise TypeError(f"fp8 must be True, False or a torchao.float8.Float8LinearConfig, got {fp8!r}.")
    reason = None if fp8.emulate else _hardware_reason(device)
    if reason is not None:
        raise ValueError(f"this Float8LinearConfig runs FP8 matmuls, but {reason}. Pass emulate=True to emulate them.")
    return fp8


def linear_filter(module: nn.Module, name: str = "") -> bool:
    """torchao's module_filter_fn: True for a plain nn.Linear whose in and out features are both multiples of 16
    (FP8 matmuls need them). Subclasses are left alone: their forward may compute something else."""
    return type(module) is nn.Linear and module.in_features % 16 == 0 and module.out_features % 16 == 0


def convertible(model: nn.Module) -> list[str]:
    """The names of the layers convert(model) would swap; refuses a model with none, saying why."""
    if isinstance(model, nn.Linear):
        raise TypeError("FP8 conversion changes a model in place: wrap a lone nn.Linear in an nn.Sequential first.")
    names = [name for name, module in model.named_modules() if linear_filter(module, name)]
    if not names:
        raise ValueError(
            f"{type(model).__name__} has no nn.Linear layer whose in and out features are both multiples of 16, "
            "which FP8 matmuls need: there is nothing to train in FP8 (train without fp8)."
        )
    return names


def convert(model: nn.Module, config=None) -> list[str]:
    """Swap `model`'s Linear layers that `linear_filter` accepts for torchao's Float8Linear (the same weight and bias
    Parameters), in place; returns their names. `config`: a torchao Float8LinearConfig (default: tensorwise). Pays
    off with torch.compile on large matmuls only (compare_speed); undo with unconvert(model)."""
    names = convertible(model)
    if not torchao_available():
        raise ImportError(f"FP8 training uses torchao, but {_TORCHAO_MISSING}.")
    from torchao.float8 import convert_to_float8_training  # an optional dependency: the fp8 extra

    convert_to_float8_training(model, module_filter_fn=linear_filter, config=config)
    return names


def unconvert(model: nn.Module) -> list[str]:
    """Swap every torchao Float8Linear in `model` back for an nn.Linear holding the same weight and bias Parameters
    (an optimizer built on them carries on); returns their names."""
    float8_linear = sys.modules.get("torchao.float8.float8_linear")
    if float8_linear is None:
        return []  # torchao never loaded: nothing was converted in this process
    swapped = []
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, float8_linear.Float8Linear):
                linear = nn.Linear(child.in_features, child.out_features, bias=False, device="meta")
                linear.weight, linear.bias = child.weight, child.bias
                linear.train(child.training)
                setattr(parent, name, linear)
                swapped.append(f"{parent_name}.{name}" if parent_name else name)
    return swapped


# (M, K, N): a Linear layer's step on inputs (M, K) with weights (K, N). torchao measured tensorwise FP8 at 0.80x
# bf16 on an H100 for the small one, both compiled; large matmuls are where FP8's twice-as-fast tensor cores show.
SPEED_SHAPES = {"small": (1024, 2048, 1024), "large": (8192, 8192, 8192)}


@dataclass
class Speed:
    """What compare_speed measured: timings[shape name][variant], variants "bf16 compiled", "fp8 compiled" and
    "fp8 eager" (FP8 without torch.compile), seconds per training step."""

    shapes: dict[str, tuple[int, int, int]]
    timings: dict[str, dict[str, Timing]]

    def speedup(self, shape: str, variant: str = "fp8 compiled") -> float:
        """How many times faster than bf16 compiled `variant` ran the step at `shape` (below 1: slower)."""
        return self.timings[shape]["bf16 compiled"].median / self.timings[shape][variant].median

    def table(self) -> Table:
        rows = [
            {
                "shape": name,
                "M, K, N": ", ".join(map(str, shape)),
                "variant": variant,
                "step (ms)": timing.median * 1e3,
                "TFLOP/s": 6 * shape[0] * shape[1] * shape[2] / timing.median / 1e12,  # 3 matmuls of 2·M·K·N
                "speed / bf16 compiled": self.speedup(name, variant),
            }
            for name, shape in self.shapes.items()
            for variant, timing in self.timings[name].items()
        ]
        return Table(rows, title="a Linear layer's training step: LayerNorm → Linear → sigmoid, forward and backward")


def _check_shape(name: str, shape) -> tuple[int, int, int]:
    if (
        len(shape) != 3
        or not all(isinstance(size, int) and size > 0 for size in shape)
        or shape[1] % 16
        or shape[2] % 16
    ):
        raise ValueError(
            f"shape {name!r} must be (M, K, N), positive integers with K and N multiples of 16; got {shape}."
        )
    return tuple(shape)


def _speed_steps(shape: tuple[int, int, int], device: torch.device, config, compile_options: dict) -> dict:
    """The step of each variant at `shape`, on bf16 weights and inputs (inputs that need gradients: the three
    matmuls of a layer inside a network, for its output, its input's gradient and its weight's gradient)."""
    rows, features, outputs = shape
    with torch.random.fork_rng(devices=[]):  # the layers' initialisation leaves the global generator as it was
        bf16 = nn.Sequential(nn.LayerNorm(features), nn.Linear(features, outputs, bias=False), nn.Sigmoid())
    bf16 = bf16.to(device, torch.bfloat16)
    fp8 = copy.deepcopy(bf16)
    convert(fp8, config)
    generator = torch.Generator(device).manual_seed(0)
    inputs = torch.randn(rows, features, device=device, dtype=torch.bfloat16, generator=generator, requires_grad=True)

    def step(model, run):
        def train_step():
            run(inputs).sum().backward()
            model.zero_grad(set_to_none=True)
            inputs.grad = None

        return train_step

    compiled = {
        name: torch.compile(model, dynamic=False, **compile_options) for name, model in (("bf16", bf16), ("fp8", fp8))
    }
    return {
        "bf16 compiled": step(bf16, compiled["bf16"]),
        "fp8 compiled": step(fp8, compiled["fp8"]),
        "fp8 eager": step(fp8, fp8),
    }


def compare_speed(
    shapes: dict[str, tuple[int, int, int]] | None = None,
    *,
    device: torch.device | str = "cuda",
    config=None,
    warmup: int = 3,
    repeats: int = 20,
    compile_options: dict | None = None,
) -> Speed:
    """Time a Linear layer's training step (LayerNorm → Linear → sigmoid on bf16 inputs (M, K), forward and
    backward) with bf16 matmuls compiled, FP8 matmuls compiled (torchao, `config`: default tensorwise) and FP8
    uncompiled, interleaved, at each of `shapes` ({name: (M, K, N)}, default SPEED_SHAPES). Refuses before any work
    where FP8 cannot run (training_config). The warm-up calls compile; `compile_options` go to torch.compile."""
    device = torch.device(device)
    config = training_config(True if config is None else config, device)
    shapes = {name: _check_shape(name, shape) for name, shape in (SPEED_SHAPES if shapes is None else shapes).items()}
    timings = {
        name: compare(
            _speed_steps(shape, device, config, compile_options or {}), device=device, warmup=warmup, repeats=repeats
        )
        for name, shape in shapes.items()
    }
    return Speed(shapes, timings)
