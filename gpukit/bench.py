"""Timing that is right on GPUs, matmul TFLOP/s, model FLOPs per step, and MFU.

GPU work is asynchronous: a Python timer around a CUDA call measures only the time to
queue the kernels. `timeit` therefore records CUDA events around each call on a CUDA
device (or synchronises around a host timer elsewhere), warms up first (cuDNN autotuning,
lazy allocation, compilation), and reports median and spread over repeats.
"""

from __future__ import annotations

import copy
import math
import statistics
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from torch.utils._pytree import tree_leaves, tree_map
from torch.utils.weak import WeakTensorKeyDictionary

from .env import resolve_device, synchronize
from .hardware.gpus import find_gpu
from .precision import PRECISIONS, matmul_format
from .step import Loss, forward_backward, split_batch, to_device

if TYPE_CHECKING:
    from torch.utils.flop_counter import FlopCounterMode

__all__ = [
    "Timing",
    "compare",
    "flops_per_step",
    "matmul_tflops",
    "mfu",
    "peak_tflops",
    "ratios",
    "synchronize",
    "timeit",
]


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

    @property
    def median_error(self) -> float:
        """Standard error of the median, from the spread: about 1.25 σ / √n, with σ ≈ IQR / 1.35 (robust to
        the outliers a shared machine adds). Two medians differ beyond noise when they differ by several of these."""
        return 1.25 * (self.iqr / 1.35) / math.sqrt(len(self.times))

    def __str__(self) -> str:
        scale, unit = (1e3, "ms") if self.median < 1 else (1, "s")
        if self.median < 1e-3:
            scale, unit = 1e6, "µs"
        return f"{self.median * scale:.3g} {unit} (median of {len(self.times)}, IQR {self.iqr * scale:.2g} {unit})"


def _check_repeats(warmup: int, repeats: int) -> None:
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0, got repeats={repeats}, warmup={warmup}.")


def timeit(
    fn: Callable[[], object],
    *,
    device: torch.device | str | None = "cpu",
    warmup: int = 2,
    repeats: int = 10,
    clock: Callable[[], float] = time.perf_counter,
) -> Timing:
    """Time `fn()` on `device`: `warmup` untimed calls, then `repeats` timed calls.

    On CUDA each call is bracketed by CUDA events, read after one final synchronisation,
    so the host never stalls between calls; elsewhere the device is synchronised around
    a reading of `clock` (seconds). `clock=time.thread_time` counts only the CPU time of the
    calling thread, which other processes on a busy machine do not inflate: right for CPU work
    on one thread (torch.set_num_threads(1)), wrong for anything that runs on other threads.
    """
    _check_repeats(warmup, repeats)
    device = torch.device(device) if device is not None else torch.device("cpu")
    for _ in range(warmup):
        fn()
    synchronize(device)
    if device.type == "cuda":
        # On `device`'s stream: record() alone would use the current device's, another GPU's for "cuda:1".
        stream = torch.cuda.current_stream(device)
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(repeats)]
        for start, end in events:
            start.record(stream)
            fn()
            end.record(stream)
        torch.cuda.synchronize(device)
        return Timing([start.elapsed_time(end) / 1e3 for start, end in events])  # elapsed_time is in ms
    times = []
    for _ in range(repeats):
        started = clock()
        fn()
        synchronize(device)
        times.append(clock() - started)
    return Timing(times)


def compare(
    fns: dict[str, Callable[[], object]],
    *,
    device: torch.device | str | None = "cpu",
    warmup: int = 2,
    repeats: int = 10,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, Timing]:
    """Time several functions interleaved (A, B, A, B, …) so drift (clocks, heat, other load)
    affects all of them alike. Returns each one's Timing; compare with `ratios`. `clock` as in timeit."""
    _check_repeats(warmup, repeats)
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            times[name] += timeit(fn, device=device, warmup=0, repeats=1, clock=clock).times
    return {name: Timing(values) for name, values in times.items()}


def ratios(timings: dict[str, Timing], baseline: str | None = None) -> dict[str, float]:
    """Median time of each entry divided by the baseline's (the first entry by default)."""
    baseline = baseline if baseline is not None else next(iter(timings))
    return {name: timing.median / timings[baseline].median for name, timing in timings.items()}


# ---------------------------------------------------------------------------------------------
# FLOPs, peaks, MFU

_DTYPES = {"fp32": torch.float32, "tf32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def matmul_tflops(
    device: str | torch.device | None = None,
    precision: str = "fp32",
    n: int = 4096,
    *,
    repeats: int = 10,
    warmup: int = 3,
    clock: Callable[[], float] = time.perf_counter,
) -> float:
    """Measured TFLOP/s of an n×n @ n×n matmul (2·n³ floating-point operations) in the number format of
    `precision` ("fp32", "tf32", "bf16-mixed", "fp16-mixed": the names fit takes). `clock` as in timeit."""
    dtype = matmul_format(precision)
    if dtype not in _DTYPES:
        raise ValueError(f"precision={precision!r} has no matmul benchmark here; use one of {', '.join(PRECISIONS)}.")
    if n <= 0:
        raise ValueError(f"n must be positive, got {n}.")
    device = resolve_device(device)
    if dtype == "tf32" and device.type != "cuda":
        raise ValueError("tf32 is a mode of NVIDIA GPUs; use precision='fp32' on this device.")
    generator = torch.Generator(device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=_DTYPES[dtype], generator=generator)
    b = torch.randn(n, n, device=device, dtype=_DTYPES[dtype], generator=generator)
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype == "tf32" else "highest")
    try:
        timing = timeit(lambda: a @ b, device=device, warmup=warmup, repeats=repeats, clock=clock)
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
    no arithmetic is done with the weights, and the model (its gradients, BatchNorm statistics) is
    left untouched. What is computed from the batch alone runs on its values (a copy), so that a
    model may check them: a Hugging Face model's `torch.all(attention_mask == 1)` works.

    A model that reads values computed from its weights (a detector's non-maximum suppression and
    proposal sampling, a branch on its own outputs) cannot run on the meta device: it is counted on a
    real forward and backward of a copy of it, on the device of its parameters, instead, and a warning
    says so. Your model, and every random generator, are left as they were.
    """
    with _generators_kept(model, batch):
        try:
            return _count_on_meta(model, batch, backward, loss_fn)
        except (_ValuesNeeded, RuntimeError, NotImplementedError) as error:  # a real run raises what is a real error
            reason = " ".join(str(error).split()) or type(error).__name__
        device = next(iter(model.parameters()), torch.empty(0)).device
        flops = _count_for_real(model, batch, device, backward, loss_fn)
    warnings.warn(
        f"flops_per_step: the meta device cannot run this model ({reason}); counted on a real forward and backward "
        f"of a copy of it on {device} instead (your model is unchanged).",
        stacklevel=2,
    )
    return flops


def _generators_kept(model: torch.nn.Module, batch):
    """torch's CPU generator and those of the CUDA devices that the model or the batch are on, restored on exit: a
    draw while counting (a model's torch.randn_like(batch), which the meta run computes on the batch's values; any
    draw of a real run) moves none of them."""
    tensors = [batch] if isinstance(batch, torch.Tensor) else split_batch(batch).tensors()
    cuda = sorted({t.device.index for t in (*model.parameters(), *tensors) if t.device.type == "cuda"})
    return torch.random.fork_rng(devices=cuda, device_type="cuda")


def _count_on_meta(model: torch.nn.Module, batch, backward: bool, loss_fn) -> int:
    meta_model = copy.deepcopy(model).to("meta")
    real = batch if isinstance(batch, torch.Tensor) else split_batch(batch)
    meta = real.to("meta") if isinstance(real, torch.Tensor) else real.map(lambda tensor: tensor.to("meta"))
    pairs = [(meta, real)] if isinstance(real, torch.Tensor) else zip(meta.tensors(), real.tensors())
    counter = _flop_counter()
    with counter, _BatchValues(pairs):
        forward_backward(meta_model, meta, Loss(loss_fn, check_targets=False), backward=backward)
    return counter.get_total_flops()


def _count_for_real(model: torch.nn.Module, batch, device: torch.device, backward: bool, loss_fn) -> int:
    copied = copy.deepcopy(model)
    batch = batch.to(device) if isinstance(batch, torch.Tensor) else to_device(split_batch(batch), device)
    counter = _flop_counter()
    with counter:
        forward_backward(copied, batch, Loss(loss_fn, check_targets=False), backward=backward)
    return counter.get_total_flops()


def _attention_backward_flops(grad_out_shape, query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """Attention's backward as the math kernel runs it: two matmuls per forward matmul (2 × the forward's FLOPs)."""
    return 2 * _attention_flops(query_shape, key_shape, value_shape)


def _attention_flops(query_shape, key_shape, value_shape, *args, **kwargs) -> int:
    """q·kᵀ and scores·v, 2 FLOPs per multiply-add; a causal mask is not subtracted. Query (B, Hq, Tq, D), key and
    value (B, Hkv, Tk, D) and (B, Hkv, Tk, Dv): grouped-query attention (Hkv < Hq, enable_gqa=True) broadcasts each
    key/value head to Hq / Hkv query heads, so every query head does the same work. (torch's own sdpa_flop_count
    asserted Hq == Hkv in the versions this kit met a GQA model with: a real run of one raised.)"""
    batch, heads, queries, width = query_shape
    keys, value_width = key_shape[-2], value_shape[-1]
    return 2 * batch * heads * queries * keys * (width + value_width)


_aten = torch.ops.aten
# The meta device runs F.scaled_dot_product_attention as the math kernel (matmuls, which the counter counts), a real
# run as a fused kernel. torch's counter has no formula for the CPU's (measured on torch 2.14: 0 FLOPs, a real count
# of a pure attention model 3.3 M where meta counts 9.6 M), and its formula for the GPU ones' backward adds the scores
# they recompute (2.5 × the forward, not 2 ×). Model FLOPs, what MFU divides, leave recomputation out: every kernel is
# counted as the math kernel, so that both paths count the same.
_ATTENTION_FLOPS = {
    _aten._scaled_dot_product_flash_attention_for_cpu: _attention_flops,
    _aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward_flops,
    _aten._scaled_dot_product_flash_attention_backward: _attention_backward_flops,
    _aten._scaled_dot_product_efficient_attention_backward: _attention_backward_flops,
    _aten._scaled_dot_product_cudnn_attention_backward: _attention_backward_flops,
}


def _flop_counter() -> FlopCounterMode:
    # Imported here, not at the top: torch's FLOP counter imports Triton where it is installed,
    # about half a second that `import gpukit` would otherwise add for every learner.
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping=_ATTENTION_FLOPS)


class _ValuesNeeded(ValueError):
    """The model reads a number from a tensor whose values the meta run does not have."""


class _BatchValues(TorchDispatchMode):
    """The batch's values beside its meta copy, so that a model may read them while its FLOPs are counted.

    A Hugging Face model checks its attention mask (`torch.all(mask == 1)`, `pad_token_id in input_ids`),
    which a meta tensor cannot answer. An operator whose meta inputs all have values (the batch's tensors
    and what is computed from them and from tensors off the meta device alone, never from the weights) runs
    on those values too, outside the counter: cheap, mask-sized work. A number read from a meta tensor is
    then read from its values.
    """

    def __init__(self, pairs):
        super().__init__()
        self.values = WeakTensorKeyDictionary()
        for meta, real in pairs:
            if real.device.type != "meta":
                self.values[meta] = real.detach().clone()  # the model may write to them: never to your batch

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        metas = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor) and x.device.type == "meta"]
        if not metas or not all(tensor in self.values for tensor in metas):
            if func is torch.ops.aten._local_scalar_dense.default:
                raise _ValuesNeeded(
                    "it reads a number (.item(), `if tensor:`) from a tensor computed from its weights or made inside "
                    "it, whose values the meta device does not have"
                )
            self._forget_written(func, args, kwargs)
            return func(*args, **kwargs)
        real_args, real_kwargs = tree_map(
            lambda x: self.values[x] if isinstance(x, torch.Tensor) and x.device.type == "meta" else x, (args, kwargs)
        )
        with _disable_current_modes():  # not counted: the model's FLOPs are the meta run's
            real = func(*real_args, **real_kwargs)
        try:
            out = func(*args, **kwargs)
        except (RuntimeError, NotImplementedError):  # a number (.item()), or a shape that depends on values
            if not any(isinstance(value, torch.Tensor) for value in tree_leaves(real)):
                return real
            out = tree_map(_meta_like, real)
        for meta, value in zip(tree_leaves(out), tree_leaves(real)):
            if isinstance(meta, torch.Tensor) and isinstance(value, torch.Tensor):
                self.values[meta] = value
        return out

    def _forget_written(self, func, args, kwargs) -> None:
        """An operator that writes to a tensor without values leaves the tensor's old values wrong: drop them."""
        for index, argument in enumerate(func._schema.arguments):
            if argument.alias_info is not None and argument.alias_info.is_write:
                written = args[index] if index < len(args) else kwargs.get(argument.name)
                for tensor in tree_leaves(written):
                    if isinstance(tensor, torch.Tensor):
                        self.values.pop(tensor, None)


def _meta_like(value):
    if not isinstance(value, torch.Tensor):
        return value
    return torch.empty_strided(value.shape, value.stride(), dtype=value.dtype, device="meta")


def peak_tflops(device_name: str, precision: str = "bf16-mixed") -> float | None:
    """Datasheet peak dense TFLOP/s of a GPU by name ("NVIDIA H100 80GB HBM3", …), or None.

    `precision` is a name fit takes ("fp32", "tf32", "bf16-mixed", "fp16-mixed") or "fp8". The
    figures come from the one GPU table, gk.hardware.GPUS (each row cites its datasheet).
    """
    gpu = find_gpu(device_name)
    return gpu.peak_tflops(precision) if gpu is not None else None


def mfu(flops_per_step: float, step_time: float, peak_tflops: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the hardware's peak (0..1)."""
    if step_time <= 0 or peak_tflops <= 0 or not math.isfinite(step_time):
        raise ValueError(f"step_time and peak_tflops must be positive, got {step_time} and {peak_tflops}.")
    return flops_per_step / step_time / (peak_tflops * 1e12)
