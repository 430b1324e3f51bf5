"""The MFU of your model measured on the machine present, and the plan's check against it.

`plan(mfu="measured")` times real steps of a copy of your model at two batch sizes other than yours
(`calibration_sizes`): a line through them gives a fixed time per step and a time per example, whose FLOP rate
against the peak is the MFU. From that line it predicts a step at your batch, and times one there too (plan.check),
so you see how far to trust what it measured. It first predicts those steps' memory (fake tensors) and measures only
where they fit what is free here; otherwise it assumes TYPICAL_MFU, and says so.
"""

from __future__ import annotations

import copy
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..bench import compare, matmul_tflops
from ..env import resolve_device
from ..memory.counting import storage_bytes
from ..memory.plan import repeated
from ..memory.prediction import predict
from ..optim import make_optimizer
from ..precision import get_precision, has_fast_kernels
from ..report import format_bytes
from ..step import Loss, TrainStep, to_device
from .gpus import find_gpu

# Used when mfu="typical": a well-tuned training run of a mid-sized model reaches 30–50% of the
# dense peak (e.g. PaLM reports 46% on TPU v4, Megatron-LM 40–50% on A100s); small models reach
# far less, which is why the default is to measure your own model on the machine present.
TYPICAL_MFU = 0.35

# mfu="measured" trains a copy of the model here, so it first predicts that run's memory (fake tensors:
# nothing runs) and measures only where the prediction times this factor fits what is free: the prediction
# leaves out allocator rounding, fragmentation and what other processes take meanwhile. A 1.07 B-parameter
# model measured without this check ran the Python process out of RAM.
MEASURE_HEADROOM = 1.25


def _present_machine(
    device: torch.device, precision: str, clock: Callable[[], float] = time.perf_counter
) -> tuple[str, float]:
    """(name, peak TFLOP/s) of the device here: the datasheet for a known GPU, else an n×n matmul
    timed by `clock`."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        row = find_gpu(name)
        peak = row.peak_tflops(precision) if row is not None else None
        if peak is not None:
            return name, peak
    elif device.type == "mps":
        name = "this Mac's GPU (MPS)"
    else:
        name = f"this CPU ({torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''})"
    on_cpu = "fp32" if precision == "tf32" and device.type != "cuda" else precision  # tf32 is a GPU mode
    return name, matmul_tflops(device, on_cpu, n=1024, repeats=3, warmup=1, clock=clock)


def calibration_sizes(size: int) -> tuple[int, int]:
    """The two batch sizes whose steps are timed to predict a step at `size`: an eighth and three quarters
    of it (at least 2 examples, as BatchNorm needs), or twice and four times a batch too small to split so.

    Far apart, so that the noise of each timing moves the line little; the larger close to `size`, so that
    the line is carried only a third further: on a CPU a batch whose activations outgrow the cache costs more
    per example (seen for the tiny CNN between 32 and 64 images), which no line through small batches knows.
    """
    small, large = max(2, size // 8), 3 * size // 4
    return (small, large) if large > small else (2 * size, 4 * size)


def _choose_mfu(mfu, model, sample, flops, optimizer, precision, device, loss_fn, repeats):
    """(MFU, where it comes from, the check on this machine) for mfu="measured", "typical" or a number.
    "measured" falls back to TYPICAL_MFU, said in one line, where measuring here would not fit in memory."""
    if mfu == "typical":
        return TYPICAL_MFU, "typical value, see TYPICAL_MFU", {}
    if mfu != "measured":
        return float(mfu), "given", {}
    too_big = _too_big_to_measure(model, sample, optimizer, precision, device, loss_fn)
    if too_big is not None:
        print(f"plan: {too_big}; assumed mfu={TYPICAL_MFU:g} (TYPICAL_MFU) instead, and checked nothing here.")
        return TYPICAL_MFU, f"typical value, see TYPICAL_MFU ({too_big})", {}
    return _measure(model, sample, flops, optimizer, precision, device, loss_fn, repeats)


def _too_big_to_measure(model, sample, optimizer, precision, device, loss_fn) -> str | None:
    """Why the measured steps (a copy of the model trained at the sample's batch and at the calibration sizes)
    would not fit the memory free here, or None where they fit (or where free memory cannot be read)."""
    device = resolve_device(device)
    fast, _ = has_fast_kernels(precision, device)
    target = device if device.type == "cuda" else torch.device("cpu")  # mps shares the host's memory
    sizes = (*calibration_sizes(sample.size), sample.size)
    step = predict(
        model,
        sample,
        max(sizes),
        optimizer=optimizer,
        precision=precision if fast else "fp32",  # as _measure_here runs it
        target=target,
        loss_fn=loss_fn,
        set_to_none=True,
    )
    batches = storage_bytes(sample.tensors()) * sum(sizes) // sample.size  # the timed batches stay on the device
    needs = {target: int((step.total + batches) * MEASURE_HEADROOM)}
    if target.type == "cuda" and next(model.parameters()).device.type == "cpu":  # copied in RAM, then moved
        host = torch.device("cpu")
        needs[host] = int(storage_bytes([*model.parameters(), *model.buffers()]) * MEASURE_HEADROOM)
    short = [
        f"{format_bytes(need)} on {where.type.upper()}, where {format_bytes(free)} is free"
        for where, need in needs.items()
        if (free := _free_bytes(where)) is not None and need > free
    ]
    return f"measuring the MFU here would need about {' and '.join(short)}" if short else None


def _free_bytes(device: torch.device) -> int | None:
    """Bytes a new allocation can take on `device`: a CUDA GPU's free memory plus what PyTorch caches unused;
    the host's available RAM, within a cgroup's (a container's) limit. None where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    available = [room for room in (_available_ram(), _cgroup_room()) if room is not None]
    return min(available) if available else None


def _available_ram() -> int | None:
    try:  # Linux: MemAvailable counts the page cache the kernel can drop, unlike MemFree
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):  # not every system has these names (macOS lacks the first)
        return None


# (limit, usage, reclaimable page cache in memory.stat) of this process's memory cgroup: version 2, then 1.
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "total_inactive_file",
    ),
)


def _cgroup_room() -> int | None:
    """A container's memory limit less what it uses (page cache it can drop excluded); None without a limit."""
    for limit_file, usage_file, cache_key in _CGROUP_FILES:
        try:
            limit = Path(limit_file).read_text().strip()
            if limit == "max":
                return None
            stat = dict(line.split()[:2] for line in (Path(limit_file).parent / "memory.stat").read_text().splitlines())
            return int(limit) - int(Path(usage_file).read_text()) + int(stat.get(cache_key, 0))
        except (OSError, ValueError):
            continue
    return None


def _measure(model, sample, flops, optimizer, precision, device, loss_fn, repeats):
    """The MFU of real steps on the machine present, and the check of the prediction here (see _measure_here).

    On a CPU, peak and steps are measured on one thread (restored afterwards): MFU is a ratio, so
    it carries over, and one thread is not thrown off by other load the way several OpenMP threads
    are (they spin waiting for each other: 8× slower steps measured on a loaded 2-core machine).
    """
    device = resolve_device(device)
    threads = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(1)
    try:
        return _measure_here(model, sample, flops, optimizer, precision, device, loss_fn, repeats)
    finally:
        torch.set_num_threads(threads)


def _prediction_noise(timings: dict, small: int, large: int, size: int) -> float:
    """The standard error of check["error"] that the timings' own spread explains: each median's standard error
    (Timing.median_error) carried through the line (predicted = a·small's + b·large's median) and the measured
    step, relative. Quiet machine: ~0.01; a busy one 0.1 or more: a bound on the error should widen with it."""
    a, b = (large - size) / (large - small), (size - small) / (large - small)
    predicted = a * timings[small].median + b * timings[large].median
    line_error = math.hypot(a * timings[small].median_error, b * timings[large].median_error) / predicted
    return math.hypot(line_error, timings[size].median_error / timings[size].median)


def _measure_here(model, sample, flops, optimizer, precision, device, loss_fn, repeats):
    """Steps timed at the two calibration sizes give a line, time = fixed + batch × per example; its slope's
    FLOP rate against the peak is the MFU. The line predicts a step at the sample's batch, which is timed
    too, interleaved with the others (so that drift and other load touch all alike), and never used by it."""
    # MFU is a ratio, so it is measured in a precision this device runs natively: a 16-bit precision
    # without fast kernels here (bf16 on most CPUs is emulated, ~50x slower than fp32) would measure
    # the emulation, and slowly. The peak is measured in the same precision as the steps.
    fast, _ = has_fast_kernels(precision, device)
    precision = precision if fast else "fp32"
    # On a CPU, the one thread's CPU time: a busy machine takes the core away for a while, which inflates the
    # wall-clock time of some steps and not others (3× seen with 6 jobs on 2 cores) but not the thread's own time.
    clock = time.thread_time if device.type == "cpu" else time.perf_counter
    name, peak = _present_machine(device, precision, clock)
    copy_of_model = copy.deepcopy(model).to(device)
    built = make_optimizer(optimizer, copy_of_model.parameters(), 1e-3, 0.0)
    step = TrainStep(copy_of_model, built, get_precision(precision, device), Loss(loss_fn))
    size = sample.size
    small, large = calibration_sizes(size)
    batches = {b: to_device(repeated(sample, b), device) for b in (small, large, size)}
    steps = {b: (lambda b=b: step(batches[b])) for b in batches}
    timings = compare(steps, device=device, repeats=repeats, clock=clock)
    seconds = {b: timing.median for b, timing in timings.items()}
    per_example = (seconds[large] - seconds[small]) / (large - small)
    fixed = seconds[small] - small * per_example  # per step whatever the batch: dispatch, launches, optimizer
    predicted = fixed + size * per_example  # seconds[size] is not used
    flops_per_example = flops / size
    mfu_value = flops_per_example / per_example / (peak * 1e12) if per_example > 0 else math.inf
    how = f"{flops_per_example / 1e9:.3g} GFLOP more per example in {per_example * 1e3:.3g} ms more"
    if not 0 < mfu_value <= 1:  # the time barely grows with the batch (launch-bound): no rate to read off the line
        mfu_value = flops_per_example * large / seconds[large] / (peak * 1e12)
        how = f"whole steps at batch {large}, as the step time barely grows with the batch here"
    check = {
        "device": name,
        "clock": {"cpu": "thread CPU time", "cuda": "CUDA events"}.get(device.type, "wall clock"),
        "timed batches": (small, large),
        "fixed ms": fixed * 1e3,
        "ms per example": per_example * 1e3,
        "predicted batch": size,
        "predicted ms": predicted * 1e3,
        "measured ms": seconds[size] * 1e3,
        "error": predicted / seconds[size] - 1,
        "noise": _prediction_noise(timings, small, large, size),
    }
    source = f"measured for this model on {name} in {precision}: {how}, against {peak:.3g} TFLOP/s"
    return mfu_value, source, check
