"""Timing that is right on GPUs, matmul TFLOP/s, model FLOPs per step, and MFU.

GPU work is asynchronous: a Python timer around a CUDA call measures only the time to
queue the kernels. `timeit` therefore records CUDA events around each call on a CUDA
device (or synchronises around a host timer elsewhere), warms up first (cuDNN autotuning,
lazy allocation, compilation), and reports median and spread over repeats.
"""

from __future__ import annotations

import copy
import math
import re
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._pytree import tree_map
from torch.utils.flop_counter import FlopCounterMode

from .env import resolve_device
from .step import Loss, forward_backward


@dataclass
class Timing:
    """Seconds per call over `repeats` timed calls."""

    times: list[float]

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def mean(self) -> float:
        return statistics.fmean(self.times)

    @property
    def std(self) -> float:
        return statistics.stdev(self.times) if len(self.times) > 1 else 0.0

    @property
    def min(self) -> float:
        return min(self.times)

    @property
    def iqr(self) -> float:
        """Interquartile range: the spread of the middle half, robust to outliers."""
        if len(self.times) < 4:
            return max(self.times) - min(self.times)
        q1, _, q3 = statistics.quantiles(self.times, n=4)
        return q3 - q1

    def __str__(self) -> str:
        scale, unit = (1e3, "ms") if self.median < 1 else (1, "s")
        if self.median < 1e-3:
            scale, unit = 1e6, "µs"
        return f"{self.median * scale:.3g} {unit} (median of {len(self.times)}, IQR {self.iqr * scale:.2g} {unit})"


def synchronize(device: torch.device | str | None) -> None:
    """Wait for all queued work on `device` (no-op on CPU)."""
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def _check_repeats(warmup: int, repeats: int) -> None:
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")


def timeit(
    fn: Callable[[], object], *, device: torch.device | str | None = "cpu", warmup: int = 2, repeats: int = 10
) -> Timing:
    """Time `fn()` on `device`: `warmup` untimed calls, then `repeats` timed calls.

    On CUDA each call is bracketed by CUDA events, read after one final synchronisation,
    so the host never stalls between calls; elsewhere the device is synchronised around
    a perf_counter reading.
    """
    _check_repeats(warmup, repeats)
    device = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
        return Timing([start.elapsed_time(end) / 1e3 for start, end in events])  # elapsed_time is in ms
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return Timing(times)


def compare(
    fns: dict[str, Callable[[], object]],
    *,
    device: torch.device | str | None = "cpu",
    warmup: int = 2,
    repeats: int = 10,
) -> dict[str, Timing]:
    """Time several functions interleaved (A, B, A, B, …) so drift (clocks, heat, other load)
    affects all of them alike. Returns each one's Timing; compare with `ratios`."""
    _check_repeats(warmup, repeats)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += timeit(fn, device=device, warmup=0, repeats=1).times
    return {name: Timing(values) for name, values in times.items()}


def ratios(timings: dict[str, Timing], baseline: str | None = None) -> dict[str, float]:
    """Median time of each entry divided by the baseline's (the first entry by default)."""
    baseline = baseline if baseline is not None else next(iter(timings))
    return {name: timing.median / timings[baseline].median for name, timing in timings.items()}


# ---------------------------------------------------------------------------------------------
# FLOPs, peaks, MFU

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_tflops(
    device: str | torch.device | None = None, dtype: str = "fp32", n: int = 4096, *, repeats: int = 10, warmup: int = 3
) -> float:
    """Measured TFLOP/s of an n×n @ n×n matmul (2·n³ floating-point operations)."""
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is unknown; use one of {', '.join(_DTYPES)}.")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}.")
    device = resolve_device(device)
    if dtype == "tf32" and device.type != "cuda":
        raise ValueError("tf32 is a mode of NVIDIA GPUs; use dtype='fp32' on this device.")
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype], generator=generator)
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype], generator=generator)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        timing = timeit(lambda: a @ b, device=device, warmup=warmup, repeats=repeats)
    finally:
        torch.set_float32_matmul_precision(previous)
    return 2 * n**3 / timing.median / 1e12


def flops_per_step(model: torch.nn.Module, batch, *, backward: bool = True, loss_fn=None) -> int:
    """Floating-point operations of one forward (and backward) pass on `batch`.

    `batch` is a batch of any form fit accepts ((inputs, target), a dict for model(**batch), …;
    see gpukit.step), whose loss is computed as fit computes it; a bare tensor is the inputs
    alone, and backward then starts from the sum of the outputs. Counted by
    torch.utils.flop_counter from the operators that run (matmuls, convolutions and attention
    dominate; elementwise ops are not counted). Backward costs about twice the forward. The
    optimizer step is not included. The count runs on a copy of the model on the meta device:
    no arithmetic is done, and the model (its gradients, BatchNorm statistics) is left untouched.
    """
    meta_model = copy.deepcopy(model).to("meta")
    meta_batch = tree_map(lambda x: x.to("meta") if isinstance(x, torch.Tensor) else x, batch)
    counter = FlopCounterMode(display=False)
    with counter:
        forward_backward(meta_model, meta_batch, Loss(loss_fn, check_targets=False), backward=backward)
    return counter.get_total_flops()


# Peak dense (no structured sparsity) tensor-core throughput in TFLOP/s, per precision.
# Sources: NVIDIA datasheets; where a sheet lists "with sparsity" figures, dense is half.
#   V100: Tesla V100 datasheet (SXM2: 15.7 FP32, 125 tensor FP16; PCIe: 14, 112)
#   T4: Tesla T4 datasheet (8.1 FP32, 65 FP16 tensor)
#   A100: A100 datasheet (19.5 FP32, 156 TF32, 312 BF16/FP16)
#   A10: A10 datasheet (31.2 FP32, 62.5 TF32, 125 BF16/FP16)
#   L4: L4 datasheet (30.3 FP32, 60 TF32, 121 BF16/FP16 dense)
#   L40S: L40S datasheet (91.6 FP32, 183 TF32, 362 BF16/FP16 dense)
#   H100 SXM / H200: H100 and H200 datasheets (67 FP32, 494.7 TF32, 989.4 BF16/FP16 dense)
#   H100 PCIe: H100 datasheet (51 FP32, 378 TF32, 756 BF16/FP16 dense)
#   H100 NVL: H100 datasheet, per GPU of the pair (60 FP32, 417.5 TF32, 835 BF16/FP16 dense)
#   L40: L40 datasheet (90.5 FP32, 90.5 TF32, 181 BF16/FP16 dense)
#   RTX 4090: Ada Lovelace architecture whitepaper (82.6 FP32, 82.6 TF32, 165.2 FP16/BF16 with FP32 accumulate)
#   RTX 3090: Ampere GA102 whitepaper (35.6 FP32, 35.6 TF32, 71 FP16/BF16 with FP32 accumulate)
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H200": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "H100 NVL": {"fp32": 60.0, "tf32": 417.5, "bf16": 835.0, "fp16": 835.0},
    "H100 PCIe": {"fp32": 51.0, "tf32": 378.0, "bf16": 756.0, "fp16": 756.0},
    "H100": {"fp32": 67.0, "tf32": 494.7, "bf16": 989.4, "fp16": 989.4},
    "A100": {"fp32": 19.5, "tf32": 156.0, "bf16": 312.0, "fp16": 312.0},
    "A10": {"fp32": 31.2, "tf32": 62.5, "bf16": 125.0, "fp16": 125.0},
    "L40S": {"fp32": 91.6, "tf32": 183.0, "bf16": 362.0, "fp16": 362.0},
    "L40": {"fp32": 90.5, "tf32": 90.5, "bf16": 181.0, "fp16": 181.0},
    "L4": {"fp32": 30.3, "tf32": 60.0, "bf16": 121.0, "fp16": 121.0},
    "RTX 4090": {"fp32": 82.6, "tf32": 82.6, "bf16": 165.2, "fp16": 165.2},
    "RTX 3090": {"fp32": 35.6, "tf32": 35.6, "bf16": 71.0, "fp16": 71.0},
    "V100 PCIe": {"fp32": 14.0, "fp16": 112.0},
    "V100": {"fp32": 15.7, "fp16": 125.0},
    "T4": {"fp32": 8.1, "fp16": 65.0},
}


def peak_tflops(device_name: str, precision: str = "bf16") -> float | None:
    """Datasheet peak dense TFLOP/s of a GPU by name ("NVIDIA H100 80GB HBM3", …), or None.

    `precision` is "fp32", "tf32", "bf16" or "fp16" (a "-mixed" suffix is ignored).
    """
    precision = precision.removesuffix("-mixed")
    # Whole words only, so that "L40" does not match "L4" and "RTX 3090 Ti" does not match "RTX 3090".
    words = set(re.split(r"[\s_-]+", device_name.upper()))
    for key, peaks in PEAK_TFLOPS.items():  # more specific names come first
        if set(key.upper().split()) <= words and not _is_variant(key, words):
            return peaks.get(precision)
    return None


def _is_variant(key: str, words: set[str]) -> bool:
    """A name with a suffix the table does not list (e.g. "Ti") is another GPU."""
    return "TI" in words and "TI" not in key.upper().split()


def mfu(flops_per_step: float, step_time: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware's peak (0..1)."""
    if step_time <= 0 or peak_tflops <= 0 or not math.isfinite(step_time):
        raise ValueError(f"step_time and peak_tflops must be positive, got {step_time} and {peak_tflops}.")
    return flops_per_step / step_time / (peak_tflops * 1e12)
