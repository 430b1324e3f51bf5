"""Which GPU for your model: what fits, the largest batch, step time, and the time and cost of a run.

Memory comes from gk.memory (fake tensors: nothing runs), step time from a roofline: a step takes at
least as long as its slowest limit, so the prediction is the longest of three times: its FLOPs at the
GPU's dense peak times a stated MFU, its memory traffic at the GPU's bandwidth, and its kernel launches
at a stated launch latency. On the machine present, `plan` times real steps at two batch sizes other
than yours: a line through them gives a fixed time per step and a time per example, whose FLOP rate
against the peak is the MFU. From that line it predicts a step at your batch, and times one there too
(plan.check), so you see how far to trust what it measured.
"""

from __future__ import annotations

import copy
import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from ..bench import compare, flops_per_step, matmul_tflops
from ..env import resolve_device
from ..memory.counting import storage_bytes
from ..memory.measuring import check_model, sample_batch
from ..memory.parts import MemoryBreakdown
from ..memory.plan import repeated
from ..memory.prediction import precision_name, predict, resized
from ..optim import make_optimizer
from ..precision import Precision, get_precision, has_fast_kernels
from ..report import Table, format_bytes
from ..step import Loss, TrainStep, forward_backward, split_batch, to_device
from ..validation import check_int, check_number
from .gpus import GPU, GPUS, find_gpu, get_gpu

# Example on-demand prices in US$ per GPU-hour, for one GPU. Prices change often and differ by
# region, provider and commitment: these are examples to compare GPUs with, not quotes. Pass
# prices={...} to plan() with yours.
PRICES_DATE = "2025-06"
PRICES_SOURCE = (
    "public on-demand list prices as of 2025-06: AWS us-east-1 (T4 g4dn.xlarge, L4 g6.xlarge, A10G g5.xlarge, "
    "L40S g6e.xlarge), Lambda (A100, H100, H200, B200, per GPU), RunPod (RTX 4090, RTX 5090); approximate"
)
PRICES: dict[str, float] = {
    "T4": 0.53,
    "L4": 0.80,
    "A10G": 1.01,
    "L40S": 1.86,
    "A100 40GB": 1.29,
    "A100 80GB": 1.79,
    "H100 SXM": 2.99,
    "H100 PCIe": 2.49,
    "H200": 3.79,
    "B200": 4.99,
    "RTX 4090": 0.69,
    "RTX 5090": 0.89,
}

# Used when mfu="typical": a well-tuned training run of a mid-sized model reaches 30–50% of the
# dense peak (e.g. PaLM reports 46% on TPU v4, Megatron-LM 40–50% on A100s); small models reach
# far less, which is why the default is to measure your own model on the machine present.
TYPICAL_MFU = 0.35

# Seconds the host needs to launch one CUDA kernel in eager PyTorch (dispatch plus launch): a few
# microseconds; 5 µs is a typical figure. Small models are bound by it, not by FLOPs: the GPU waits
# for the next kernel. CUDA graphs and torch.compile remove most of it.
LAUNCH_SECONDS = 5e-6

# mfu="measured" trains a copy of the model here, so it first predicts that run's memory (fake tensors:
# nothing runs) and measures only where the prediction times this factor fits what is free: the prediction
# leaves out allocator rounding, fragmentation and what other processes take meanwhile. A 1.07 B-parameter
# model measured without this check ran the Python process out of RAM.
MEASURE_HEADROOM = 1.25


def step_traffic(memory: MemoryBreakdown) -> int:
    """Bytes a training step moves to and from device memory, at least: activations written in the
    forward and read in the backward (2×), parameters read in forward and backward and written by
    the optimizer (3×), gradients written and read (2×), optimizer state read and written (2×).
    Kernels re-read intermediate tensors too, so real traffic is higher: a lower bound."""
    return 2 * memory.activations + 3 * memory.params + 2 * memory.grads + 2 * memory.optimizer_state


def count_kernels(model: nn.Module, batch, loss_fn=None) -> int:
    """Operators of one forward and backward that compute (views excluded): about one CUDA kernel
    each in eager mode. Counted on a copy of the model on the meta device (nothing runs)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counter(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not func.is_view:
                self.count += 1
            return func(*args, **(kwargs or {}))

    meta_model = copy.deepcopy(model).to("meta")
    meta_batch = split_batch(batch).map(lambda tensor: tensor.to("meta"))
    with Counter() as counter:
        forward_backward(meta_model, meta_batch, Loss(loss_fn, check_targets=False))
    return counter.count


@dataclass
class PlanRow:
    """One GPU's answer. Times in seconds, memory in bytes, cost in US$."""

    gpu: str
    memory_total: int
    usable: int  # memory less the margin
    needed: int  # predicted peak at the plan's batch size
    fits: bool
    largest_batch: int  # the largest batch whose step fits `usable` (0: not even one example)
    step_time: float | None  # None: the GPU has no tensor cores for this precision
    bound: str | None  # "compute", "memory" or "launch": which roof limits the step
    hours: float | None
    price: float | None  # US$ per GPU-hour
    cost: float | None  # US$ for the run
    pareto: bool = False  # no other GPU is both faster and cheaper

    def as_dict(self) -> dict:
        return {
            "gpu": self.gpu,
            "fits": self.fits,
            "needs": format_bytes(self.needed),
            "usable": format_bytes(self.usable),
            "largest batch": self.largest_batch,
            "step ms": None if self.step_time is None else self.step_time * 1e3,
            "bound": self.bound,
            "hours": self.hours,
            "$/GPU-h": self.price,
            "cost $": self.cost,
            "Pareto": self.pareto,
        }


@dataclass
class Plan:
    """What `plan` found: one PlanRow per GPU, the quantities behind them, and the check on this machine."""

    rows: list[PlanRow]
    batch_size: int
    steps: int
    precision: str
    optimizer: str
    margin: float
    flops: int  # per step at batch_size
    traffic: int  # bytes per step at batch_size (a lower bound, see step_traffic)
    kernels: int  # kernel launches per step (forward and backward; see count_kernels)
    memory: MemoryBreakdown  # the prediction at batch_size (for CUDA)
    mfu: float
    mfu_source: str
    prices_source: str
    check: dict = field(default_factory=dict)  # this machine: a step at batch_size predicted, and measured

    def row(self, gpu: str) -> PlanRow:
        name = get_gpu(gpu).name
        return next(row for row in self.rows if row.gpu == name)

    @property
    def pareto(self) -> list[PlanRow]:
        """The GPUs on the cost–time frontier, fastest first."""
        return sorted((row for row in self.rows if row.pareto), key=lambda row: row.hours)

    def table(self) -> Table:
        title = (
            f"batch {self.batch_size}, {self.steps:,} steps, {self.precision}, {self.optimizer}: "
            f"{self.flops / 1e9:.3g} GFLOP, ≥ {format_bytes(self.traffic)} moved and {self.kernels} kernels per step "
            f"({LAUNCH_SECONDS * 1e6:g} µs each), {self.margin:.0%} memory margin. Step times, hours and costs rest on "
            f"one MFU, {self.mfu:.0%} ({self.mfu_source}), assumed for every GPU: {self._mfu_caveat()}"
        )
        return Table([row.as_dict() for row in self.rows], title=title)

    def _mfu_caveat(self) -> str:
        if self.check:
            return f"measured on {self.check['device']} only, not on the other GPUs of the table"
        return "measured on none of them"

    def check_table(self) -> Table:
        """This machine: the step time the model predicts against the one measured."""
        return Table([self.check], title="the prediction checked on this machine") if self.check else Table([])

    def __str__(self) -> str:
        return "\n\n".join(str(table) for table in (self.table(), self.check_table()) if len(table))

    __repr__ = __str__

    def _repr_html_(self) -> str:
        return "".join(table._repr_html_() for table in (self.table(), self.check_table()) if len(table))

    def plot(self):
        """Cost of the run against hours to train, one point per GPU that fits; the frontier joined."""
        from ..figures import subplots

        shown = [row for row in self.rows if row.cost is not None]
        figure, axis = subplots(figsize=(6.5, 4.5))
        for row in shown:
            axis.scatter(row.hours, row.cost, color="C3" if row.pareto else "C0", zorder=3)
            axis.annotate(row.gpu, (row.hours, row.cost), textcoords="offset points", xytext=(4, 4), fontsize=8)
        frontier = self.pareto
        if frontier:
            axis.plot(
                [r.hours for r in frontier],
                [r.cost for r in frontier],
                "--",
                color="C3",
                label="Pareto frontier (nothing both faster and cheaper)",
            )
            axis.legend(fontsize=8)
        axis.set(
            xlabel="hours to train",
            ylabel="cost of the run (US$)",
            xscale="log",
            yscale="log",
            title=f"{self.steps:,} steps at batch {self.batch_size}, MFU {self.mfu:.0%}",
        )
        axis.grid(alpha=0.3, which="both")
        figure.tight_layout()
        return figure


def _mark_pareto(rows: list[PlanRow]) -> None:
    priced = [row for row in rows if row.cost is not None]
    for row in priced:
        row.pareto = not any(
            other.hours <= row.hours and other.cost <= row.cost and (other.hours < row.hours or other.cost < row.cost)
            for other in priced
        )


def _check_prices(prices: dict) -> dict[str, float]:
    checked = {}
    for name, price in prices.items():
        check_number(f"the price of {name}", price, note="of US$ per GPU-hour")
        checked[get_gpu(name).name] = float(price)
    return checked


def _largest_batches(
    peak: Callable[[int], int], usables: dict[int, int], size: int, activations: int
) -> dict[int, int]:
    """The largest batch under each usable budget (bytes), such that peak(b) ≤ usable < peak(b + 1).

    The peak is a line in the batch size once activations dominate: a line through the sample's
    prediction and one near the largest answer (guessed from the activations per example) gives
    every answer; it is checked at the smallest and the largest budget, and only where the check
    fails does each answer get corrected by further predictions.
    """
    per_example = max(activations / size, 1.0)
    far = max(size + 1, size + int((max(usables.values()) - peak(size)) / per_example))
    slope = max((peak(far) - peak(size)) / (far - size), 1.0)

    def from_line(usable: int) -> int:
        return max(0, size + math.floor((usable - peak(size)) / slope))

    def corrected(usable: int, answer: int) -> int:
        for _ in range(16):  # each move is by the error in examples: one or two suffice
            if answer >= 1 and peak(answer) > usable:
                answer = max(0, answer - max(1, int((peak(answer) - usable) / slope)))
            elif peak(answer + 1) <= usable:
                answer += max(1, int((usable - peak(answer + 1)) / slope))
            else:
                return answer
        return answer

    budgets = sorted(set(usables.values()))
    answers = {usable: from_line(usable) for usable in budgets}
    ends = {usable: corrected(usable, answers[usable]) for usable in (budgets[0], budgets[-1])}
    if any(ends[usable] != answers[usable] for usable in ends):  # the line is off: correct every answer
        answers = {usable: corrected(usable, answers[usable]) for usable in budgets}
    answers |= ends
    return {memory: answers[usable] for memory, usable in usables.items()}


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


def plan(
    model: nn.Module,
    batch,
    labels: torch.Tensor | None = None,
    *,
    steps: int = 10_000,
    gpus: Sequence[str | GPU] | None = None,
    optimizer: str = "adamw",
    precision: str | Precision = "bf16-mixed",
    margin: float = 0.1,
    mfu: float | str = "measured",
    prices: dict[str, float] | None = None,
    device: str | torch.device | None = None,
    loss_fn: str | Callable | None = None,
    repeats: int = 9,
) -> Plan:
    """For each GPU: does a training step of `model` on `batch` fit, the largest batch that fits, the
    predicted step time, and the time and cost of `steps` optimizer steps.

    batch: an example batch of any form fit accepts (its size is the plan's batch size).
    margin: the fraction of each GPU's memory kept free (allocator fragmentation, cuDNN workspaces,
        the CUDA context: the prediction does not include them).
    mfu: the fraction of a GPU's dense peak the step reaches. "measured" (default): measured for
        this model on the machine present (`device`, default the best here; on a CPU against the
        CPU's own measured matmul peak) and assumed for every GPU, unless those steps would not fit in the
        memory free here (predicted first, with fake tensors): then TYPICAL_MFU, said in one printed line;
        "typical": TYPICAL_MFU; or a number.
    prices: US$ per GPU-hour by GPU name, on top of the example PRICES (see PRICES_SOURCE).
    With mfu="measured", the prediction is also checked here (plan.check): steps timed at the two batch
    sizes `calibration_sizes` gives (not yours) predict a step at your batch (a line: a fixed time per
    step plus a time per example), against a step timed at your batch, all interleaved. On a CPU they
    run on one thread and are timed by its CPU time (time.thread_time), which other processes on a busy
    machine do not inflate. `repeats`: timed steps at each size (their median counts), after 2 untimed.
    Your model is not changed (the measured steps train a copy).
    """
    check_model(model)
    sample = sample_batch(model, batch, labels)
    precision = precision_name(precision)
    check_int("steps", steps, note="(optimizer steps)")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}; 0.1 keeps 10% of memory free.")
    if mfu not in ("measured", "typical") and (isinstance(mfu, (str, bool)) or not 0 < mfu <= 1):
        raise ValueError(f"mfu must be 'measured', 'typical' or a fraction in (0, 1], got {mfu!r}.")
    chosen = [get_gpu(gpu) for gpu in (gpus if gpus is not None else GPUS.values())]
    if not chosen:
        raise ValueError("gpus is empty; leave it out to plan for every GPU in gk.hardware.GPUS.")
    price_table = PRICES | _check_prices(prices or {})
    size = sample.size
    target = torch.device("cuda")

    @functools.cache
    def predicted(batch_size: int) -> MemoryBreakdown:
        return predict(
            model,
            sample,
            batch_size,
            optimizer=optimizer,
            precision=precision,
            target=target,
            loss_fn=loss_fn,
            set_to_none=True,
        )

    memory = predicted(size)
    flops = flops_per_step(model, resized(sample, size, torch.device("meta")), loss_fn=loss_fn)
    traffic = step_traffic(memory)
    kernels = count_kernels(model, sample, loss_fn)
    usables = {gpu.memory_bytes: int(gpu.memory_bytes * (1 - margin)) for gpu in chosen}
    largest = _largest_batches(lambda b: predicted(b).total, usables, size, memory.activations)

    measuring = (optimizer, precision, device, loss_fn, repeats)
    mfu_value, mfu_source, check = _choose_mfu(mfu, model, sample, flops, *measuring)
    work = {"flops": flops, "traffic": traffic, "kernels": kernels, "mfu": mfu_value, "steps": steps}
    rows = [
        _row(gpu, usables[gpu.memory_bytes], memory.total, largest[gpu.memory_bytes], price_table.get(gpu.name),
             precision, **work)
        for gpu in chosen
    ]  # fmt: skip
    if not any(row.fits for row in rows):
        raise ValueError(_fits_nowhere(rows, memory, size, precision, optimizer))
    _mark_pareto(rows)
    source = PRICES_SOURCE + ("; some given by you" if prices else "")
    return Plan(
        rows,
        size,
        steps,
        precision,
        optimizer,
        margin,
        flops,
        traffic,
        kernels,
        memory,
        mfu_value,
        mfu_source,
        source,
        check,
    )


def _row(
    gpu: GPU, usable: int, needed: int, largest: int, price, precision: str, *, flops, traffic, kernels, mfu, steps
) -> PlanRow:
    """One GPU's row: does the step fit, the roofline step time and what bounds it, time and cost of the run."""
    peak = gpu.peak_tflops(precision)
    fits = needed <= usable
    step_time = bound = hours = cost = None
    if peak is not None:
        roofs = {
            "compute": flops / (peak * 1e12 * mfu),
            "memory": traffic / (gpu.bandwidth_tbs * 1e12),
            "launch": kernels * LAUNCH_SECONDS,
        }
        bound = max(roofs, key=roofs.get)
        step_time = roofs[bound]
    if fits and step_time is not None:
        hours = step_time * steps / 3600
        cost = hours * price if price is not None else None
    return PlanRow(gpu.name, gpu.memory_bytes, usable, needed, fits, largest, step_time, bound, hours, price, cost)


def _fits_nowhere(rows: list[PlanRow], memory: MemoryBreakdown, size: int, precision: str, optimizer: str) -> str:
    biggest = max(rows, key=lambda row: row.usable)
    fixes = [
        f"a smaller batch ({biggest.largest_batch} fits the {biggest.gpu})" if biggest.largest_batch else None,
        "precision='bf16-mixed'" if precision in ("fp32", "tf32") else None,
        "optimizer='nesterov' (less optimizer state)" if optimizer not in ("sgd", "nesterov", "momentum") else None,
        "activation checkpointing (gk.memory.apply_activation_checkpointing)",
        "gradient accumulation (fit(accumulate=k))",
        "sharding over several GPUs (FSDP, lesson 04)",
    ]
    return (
        f"a step at batch {size} needs {format_bytes(memory.total)}, but the largest GPU in the table, the "
        f"{biggest.gpu}, has {format_bytes(biggest.usable)} usable: {format_bytes(memory.total - biggest.usable)} "
        f"short. Fixes from lesson 03: {', '.join(fix for fix in fixes if fix)}."
    )


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
