"""Inference speed: latency and throughput against batch size, precision, memory layout and compilation.

Serving is not training: no backward, no optimizer, and a request waits for its whole batch. Two numbers
matter and pull apart: **latency**, the seconds one batch takes (what a user waits), and **throughput**, the
examples per second (what a machine serves). A larger batch fills the device better, so throughput rises,
but every request in it waits longer. `measure` times a model's forward under `torch.inference_mode` for
each batch size, interleaved, with `gk.bench.compare` (CUDA events on a GPU), so that variants can be set side
by side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .bench import compare
from .env import resolve_device
from .precision import get_precision

__all__ = ["InferenceRow", "measure"]


@dataclass
class InferenceRow:
    """One batch size of one variant: median seconds per batch and examples per second."""

    variant: str
    batch_size: int
    latency: float  # seconds per batch (median of the repeats)
    throughput: float  # examples per second: batch_size / latency
    spread: float  # interquartile range of the latency, seconds
    best: float  # the fastest batch, seconds: the least disturbed by other work on a busy machine


def measure(
    model: nn.Module,
    make_input: Callable[[int], torch.Tensor],
    batch_sizes: Sequence[int],
    *,
    precision: str = "fp32",
    channels_last: bool = False,
    compile: bool = False,
    device: str | torch.device | None = "cpu",
    warmup: int = 2,
    repeats: int = 10,
    variant: str | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[InferenceRow]:
    """Time `model(make_input(b))` for every batch size b, in eval mode under torch.inference_mode.

    `make_input(b)` returns a batch of b examples (on any device; it is moved to `device`). The model is
    used as given (copy it first if it must stay in training mode or in its layout): it is put in eval
    mode, moved to `device`, converted to channels_last if asked, and compiled once if asked (the first
    calls of each new shape compile, so `warmup` must cover them: at least 2 with compile). `clock` as in
    gk.bench.timeit: time.thread_time on a busy CPU with one thread (a wall clock there makes long calls lose
    more to other jobs than short ones, and so the gain of a large batch shrinks with the load).
    """
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes must be positive integers, got {batch_sizes!r}.")
    if compile and warmup < 2:
        raise ValueError("compile=True needs warmup >= 2: the first calls of each shape compile.")
    device = resolve_device(device)
    numerics = get_precision(precision, device)
    model = model.to(device).eval()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    runner = torch.compile(model) if compile else model
    name = variant or "+".join([precision] + ["channels_last"] * channels_last + ["compiled"] * compile)
    calls = {}
    for batch_size in batch_sizes:
        inputs = make_input(batch_size).to(device)
        if channels_last:
            inputs = inputs.contiguous(memory_format=torch.channels_last)

        def forward(inputs=inputs):
            with torch.inference_mode(), numerics.flags(), numerics.autocast():
                return runner(inputs)

        calls[batch_size] = forward
    # Interleaved (1, 8, 64, 1, 8, 64, ...): drift and other load affect every batch size alike.
    timings = compare(calls, device=device, warmup=warmup, repeats=repeats, clock=clock)
    return [InferenceRow(name, b, t.median, b / t.median, t.iqr, t.min) for b, t in timings.items()]
