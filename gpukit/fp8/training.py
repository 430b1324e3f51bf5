"""FP8 training with torchao: whether a device can (`supported`), fit's `fp8` argument checked before any work
(`training_config`), and the model's Linear layers swapped for torchao's Float8Linear (`convert`) and back
(`unconvert`)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys

import torch
from torch import nn

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
