"""See the input pipeline overlap: a torch.profiler trace of a few training steps, drawn as a timeline.

`trace_steps(loader, model)` runs steps the way `fit` does (batches through `prefetch`, one TrainStep
each) under torch.profiler, labels the host's phases ("data wait": inside next(loader); "step": the
forward, backward and optimizer step as launched), exports the Chrome/Perfetto trace, and returns the
intervals per row. On a GPU the device rows come from the device activities' own intervals: "copy" (the
memcpy host→device) and "compute" (kernels). Overlap means copy bars under compute bars.

Not everything the profiler puts on the device is a kernel: Kineto also reports each `record_function` span
(our "data wait" and "step", "ProfilerStep#N") as a GPU user annotation with device type CUDA, covering every
kernel launched inside it; memcpy in other directions, memsets and synchronisations are device events too.
Counted as compute, the annotations alone make any copy look hidden. `device_row` keeps only kernels and
host→device copies.
"""

from __future__ import annotations

import contextlib
import copy as copying
import os
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile, record_function

from ..env import resolve_device, synchronize
from ..precision import get_precision
from ..step import Loss, TrainStep, split_batch, to_device
from .prefetching import prefetch

HOST_PHASES = ("data wait", "step")


@dataclass
class Trace:
    """Intervals (start, duration) in milliseconds from the trace's start, per row."""

    rows: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    steps: int = 0
    device: str = "cpu"
    chrome_trace: str | None = None

    def total(self, row: str) -> float:
        """Milliseconds covered by one row's intervals."""
        return sum(duration for _, duration in self.rows.get(row, []))

    def hidden_copy_fraction(self) -> float | None:
        """The share of the copy time that ran while a compute kernel ran too; None without copies."""
        copies, kernels = self.rows.get("copy", []), self.rows.get("compute", [])
        total = sum(duration for _, duration in copies)
        if not total:
            return None
        return _overlap(copies, kernels) / total

    def kernel_share(self) -> float | None:
        """The share of the traced steps' time (from the first step's launch to the last kernel's end) in which a
        kernel ran; None without kernels. Low means the GPU idled between kernels (a launch-bound step): a copy
        issued after a step's launch then finds no compute to hide behind."""
        kernels, steps = self.rows.get("compute", []), self.rows.get("step", [])
        if not kernels or not steps:
            return None
        start = min(begin for begin, _ in steps)
        end = max(begin + duration for begin, duration in kernels + steps)
        busy = sum(min(stop, end) - max(begin, start) for begin, stop in _merge(kernels) if stop > start)
        return busy / (end - start)


def _overlap(first: list[tuple[float, float]], second: list[tuple[float, float]]) -> float:
    merged = _merge(second)
    covered = 0.0
    for start, duration in first:
        end = start + duration
        for other_start, other_end in merged:
            covered += max(0.0, min(end, other_end) - max(start, other_start))
    return covered


def _merge(intervals):
    merged = []
    for start, duration in sorted(intervals):
        end = start + duration
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def trace_steps(
    loader: Iterable,
    model: nn.Module,
    *,
    steps: int = 6,
    device: str | torch.device | None = None,
    precision: str = "fp32",
    loss_fn: str | Callable | None = None,
    chrome_trace: str | os.PathLike | None = None,
) -> Trace:
    """Profile `steps` training steps on a copy of `model` fed by `loader` (through `prefetch` on CUDA)."""
    device = resolve_device(device)
    precision = get_precision(precision, device)
    trained = copying.deepcopy(model).to(device).train()
    step = TrainStep(trained, torch.optim.SGD(trained.parameters(), lr=1e-3), precision, Loss(loss_fn))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    source = iter(prefetch(loader, device))
    with precision.flags():
        step(next(source))  # warm-up outside the trace: first-call costs are not the pipeline's
        # The first traced batch is fetched before the trace too: its copy would be issued while the GPU idles
        # through the profiler's start-up. Each traced copy is then issued as in `fit`, right after a step's launch.
        raw = next(source, None)
        with quiet_kineto_without_cuda(), profile(activities=activities) as profiler:
            done = 0
            while raw is not None and done < steps:
                with record_function("step"):
                    step(to_device(split_batch(raw), device))
                done += 1
                with record_function("data wait"):
                    raw = next(source, None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    if chrome_trace is not None:
        profiler.export_chrome_trace(str(chrome_trace))
    return _intervals(profiler.events(), done, str(device), None if chrome_trace is None else str(chrome_trace))


@contextlib.contextmanager
def quiet_kineto_without_cuda() -> Iterator[None]:
    """Silence torch.profiler's Kineto on a machine without a CUDA device, where a CUDA build of torch prints
    "ERROR ... gpuGetDeviceCount failed with code 35" and a line per profiler start and stop to stderr: noise
    under a lesson's cell. Kineto reads KINETO_LOG_LEVEL once, at a process's first profile, so level 6 (nothing)
    set around that profile keeps it quiet for the process; the variable itself is put back afterwards. A level
    the user set, and a machine with CUDA (whose messages can matter), are left alone."""
    if torch.cuda.is_available() or "KINETO_LOG_LEVEL" in os.environ:
        yield
        return
    os.environ["KINETO_LOG_LEVEL"] = "6"
    try:
        yield
    finally:
        del os.environ["KINETO_LOG_LEVEL"]


def kernel_seconds(function: Callable[[], object], calls: int, device: torch.device) -> float | None:
    """Seconds in which a kernel ran on the CUDA `device` (the union of the kernels' own intervals, from
    torch.profiler's CUDA activity) during `calls` calls of `function`; None where the profiler saw no kernel
    (no CUPTI here, or the work ran elsewhere). The kernels' times are the GPU's own: the profiler slows the
    host's launches, not them."""
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as profiler:
        for _ in range(calls):
            function()
        synchronize(device)  # CUDA's wait; on any other device nothing to wait for, and no kernel is seen
    kernels = _intervals(profiler.events(), calls, str(device), None).rows.get("compute", [])
    busy = sum(end - start for start, end in _merge(kernels))  # milliseconds
    return busy / 1e3 if busy > 0 else None


# Device events that are not kernels, by Kineto's names: copies and memsets, CUDA synchronisations.
_NOT_KERNELS = ("Memcpy", "Memset", "Event Sync", "Stream Sync", "Context Sync", "Stream Wait Event")


def device_row(event) -> str | None:
    """The device row of one profiler event (a FunctionEvent): "copy" for a host→device memcpy, "compute" for a
    kernel, None for anything else (host events, user annotations, other copies, memsets, synchronisations)."""
    if event.device_type != DeviceType.CUDA:
        return None
    # FunctionEvent.activity_type ("kernel", "gpu_memcpy", "gpu_user_annotation", ...) is in torch 2.14 but not in
    # every older torch; is_user_annotation is older. Kineto's names are the fallback where either is missing.
    activity = (getattr(event, "activity_type", None) or "").lower()
    name = event.name
    if getattr(event, "is_user_annotation", False) or "user_annotation" in activity:
        return None
    if name in HOST_PHASES or name.startswith("ProfilerStep"):  # our own spans, seen on the device
        return None
    if name.startswith("Memcpy HtoD"):  # Kineto's names: "Memcpy HtoD (Pinned -> Device)", "(Pageable -> ...)"
        return "copy"
    if activity:
        return "compute" if activity == "kernel" else None
    return None if name.startswith(_NOT_KERNELS) else "compute"


def _intervals(events, steps: int, device: str, path: str | None) -> Trace:
    rows: dict[str, list[tuple[float, float]]] = {name: [] for name in HOST_PHASES}
    if device.startswith("cuda"):
        rows |= {"copy": [], "compute": []}
    origin = min((event.time_range.start for event in events), default=0)
    for event in events:
        start, duration = (event.time_range.start - origin) / 1e3, event.time_range.elapsed_us() / 1e3
        row = device_row(event)
        if row in rows:
            rows[row].append((start, duration))
        elif event.device_type == DeviceType.CPU and event.name in HOST_PHASES:
            rows[event.name].append((start, duration))
    return Trace(rows, steps, device, path)


def plot_trace(trace: Trace, title: str | None = None):
    """One row per phase (host: data wait, step; device: copy, compute), bars where it was busy."""
    from ..figures import subplots

    names = [name for name in ("data wait", "step", "copy", "compute") if name in trace.rows]
    colours = {"data wait": "tab:red", "step": "tab:blue", "copy": "tab:orange", "compute": "tab:green"}
    figure, axes = subplots(figsize=(9, 0.6 * len(names) + 1.2))
    for row, name in enumerate(names):
        axes.broken_barh(trace.rows[name], (row - 0.4, 0.8), color=colours[name])
    axes.set_yticks(range(len(names)), [f"{name} ({'host' if name in HOST_PHASES else 'GPU'})" for name in names])
    axes.invert_yaxis()
    axes.set_xlabel("time (ms)")
    axes.set_title(title or f"{trace.steps} training steps on {trace.device}")
    figure.tight_layout()
    return figure
