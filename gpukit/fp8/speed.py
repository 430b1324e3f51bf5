"""Does FP8 pay here? `compare_speed` times a Linear layer's training step with bf16 and FP8 matmuls, compiled and
not, at a small and a large shape: FP8 pays only on large matmuls, compiled."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..bench import Timing, compare
from ..report import Table
from .training import convert, training_config

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
