"""Is training waiting for data? `diagnose()` finds the bottleneck; `sweep()` tunes the DataLoader.

`diagnose(loader, model)` times three things on the same batches, for any model and batch form
(gpukit.step): the loader alone (batches produced and copied to the device), the training step
alone (repeated on one batch already on the device), and both together as training runs them.
If the loader alone delivers fewer batches per second than the step consumes, training is
input-bound: a faster model or GPU changes nothing until the input side is fixed.

On a GPU it also says whether the step alone is **launch-bound**: the GPU idle most of the step while
the host launches kernels one by one (a small model, or a small batch, on a fast GPU). Then a faster
GPU, mixed precision or more loader workers change nothing; fewer, larger launches do (a larger batch,
CUDA graphs, torch.compile). `step_bound` decides from two measured shares of the step's time, a pure
function that tests feed with made-up measurements.

`sweep(dataset, batch_size)` measures a DataLoader's batches per second over a grid of
`num_workers` × `prefetch_factor`; `plot_sweep` draws it. They, and the loader timed alone, are
loader_timing.py's.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..env import resolve_device, synchronize
from ..precision import Precision, get_precision
from ..report import Table
from ..step import Batch, Loss, TrainStep
from ..validation import check_int
from .loader_timing import (
    SlowDataset,
    _cycle,
    _on_device,
    _time_loader,
    check_workers,
    loader_rate,
    plot_sweep,
    sweep,
)
from .prefetching import prefetch
from .timeline import kernel_seconds

__all__ = [
    "LAUNCH_BOUND_HOST_SHARE",
    "LAUNCH_BOUND_KERNEL_SHARE",
    "PROFILED_STEPS",
    "Diagnosis",
    "SlowDataset",
    "check_workers",
    "diagnose",
    "loader_rate",
    "plot_sweep",
    "step_bound",
    "sweep",
]

# A step is launch-bound when kernels ran in less than half of its wall time (the GPU idled most of it) while the
# host spent at least 80% of it inside the step's calls, launching them: the host sets the pace, not the GPU.
LAUNCH_BOUND_KERNEL_SHARE = 0.5
LAUNCH_BOUND_HOST_SHARE = 0.8
PROFILED_STEPS = 5  # steps of the step alone run again under the profiler to time the kernels (CUDA only)


def step_bound(kernel_share: float, host_share: float) -> str:
    """'launch-bound' or 'compute-bound': what sets the pace of a training step on a GPU.

    kernel_share: the share of the step's wall time in which a kernel ran on the GPU (kernel intervals merged);
    host_share:   the share of it the host spent inside the step's calls (launching its kernels).
    Launch-bound when kernel_share < LAUNCH_BOUND_KERNEL_SHARE and host_share >= LAUNCH_BOUND_HOST_SHARE: the
    GPU waits between kernels for the host to launch the next. Otherwise the GPU's work sets the pace.
    """
    for name, value in (("kernel_share", kernel_share), ("host_share", host_share)):
        if not 0 <= value <= 1:
            raise ValueError(f"{name} must be a share of the step's wall time, in [0, 1]; got {value!r}.")
    launch_bound = kernel_share < LAUNCH_BOUND_KERNEL_SHARE and host_share >= LAUNCH_BOUND_HOST_SHARE
    return "launch-bound" if launch_bound else "compute-bound"


@dataclass
class Diagnosis:
    """What `diagnose` measured. Rates are optimizer steps (batches) per second.

    data_wait_fraction: the share of the combined run's time the training loop spent waiting for the
        next batch (inside next(loader) and the copy to the device), measured on the host.
    kernel_share, host_share: CUDA only (None elsewhere, or where the profiler saw no kernel): of the step
        alone's wall time, the share in which a kernel ran and the share the host spent in the step's calls
        (see step_bound).
    """

    loader_steps_per_second: float
    step_steps_per_second: float
    together_steps_per_second: float
    data_wait_fraction: float
    batch_size: int
    steps: int
    device: str
    advice: list[str] = field(default_factory=list)
    kernel_share: float | None = None
    host_share: float | None = None

    @property
    def verdict(self) -> str:
        """'input-bound' when the loader alone is slower than the step alone; else, on a GPU, 'launch-bound' when
        the step alone is (step_bound), and 'compute-bound' otherwise."""
        if self.loader_steps_per_second < self.step_steps_per_second:
            return "input-bound"
        if self.kernel_share is not None and self.host_share is not None:
            return step_bound(self.kernel_share, self.host_share)
        return "compute-bound"

    @property
    def input_bound(self) -> bool:
        return self.verdict == "input-bound"

    def table(self) -> Table:
        rows = [
            {"measured": "loader alone", "steps_per_second": self.loader_steps_per_second},
            {"measured": "training step alone (one resident batch)", "steps_per_second": self.step_steps_per_second},
            {"measured": "both together", "steps_per_second": self.together_steps_per_second},
        ]
        for row in rows:
            row["samples_per_second"] = row["steps_per_second"] * self.batch_size
        return Table(
            rows,
            title=f"{self.verdict}: {self.data_wait_fraction:.0%} of step time waiting for data "
            f"({self.steps} steps of {self.batch_size} on {self.device})",
        )

    def __str__(self) -> str:
        lines = [
            f"{self.verdict} on {self.device}: loader {self.loader_steps_per_second:.1f} steps/s, step alone "
            f"{self.step_steps_per_second:.1f} steps/s, together {self.together_steps_per_second:.1f} steps/s; "
            f"{self.data_wait_fraction:.0%} of the time waiting for data.",
        ]
        if self.kernel_share is not None:
            lines.append(
                f"The step alone: kernels ran {self.kernel_share:.0%} of its time, the host was launching "
                f"{self.host_share:.0%} of it."
            )
        lines.append("What to try, in order:")
        lines += [f"  {number}. {line}" for number, line in enumerate(self.advice, 1)]
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        advice = "".join(f"<li>{line}</li>" for line in self.advice)
        return self.table()._repr_html_() + f"<p>What to try, in order:</p><ol>{advice}</ol>"


def _advice(loader, device: torch.device, input_bound: bool, launch_bound: bool = False) -> list[str]:
    cores = os.cpu_count() or 1
    if not input_bound and launch_bound:
        return [
            "a larger batch: more work in each kernel for the same number of launches, so the step's time grows "
            "little until the GPU is busy.",
            "CUDA graphs: the whole step replayed with one launch (torch.compile(model, mode='reduce-overhead'), "
            "or torch.cuda.graphs).",
            "torch.compile: fused operators, fewer kernels to launch; a fused optimizer (fused=True) does the same "
            "for the update.",
            "nothing that adds launches: activation checkpointing recomputes the forward, a whole extra "
            "launch-bound forward here; a faster GPU or mixed precision will not help either.",
        ]
    if not input_bound:
        return [
            "the input keeps up and the step is the bottleneck: speed up the step itself (mixed precision, "
            "channels_last, torch.compile, a larger batch); more loader workers will not help.",
        ]
    advice = []
    if isinstance(loader, DataLoader):
        if loader.num_workers == 0:
            advice.append(f"load in worker processes: num_workers=2..{cores} (this machine has {cores} CPU cores).")
        else:
            if not loader.persistent_workers:
                advice.append(
                    "persistent_workers=True: keep the workers alive between epochs instead of restarting them."
                )
            advice.append(
                f"a larger prefetch_factor (now {loader.prefetch_factor}) or more workers "
                f"(now {loader.num_workers}, {cores} cores): gk.data.sweep() measures both."
            )
        if device.type == "cuda" and not loader.pin_memory:
            advice.append(
                "pin_memory=True, so the copy to the GPU runs asynchronously (fit overlaps it on a side stream)."
            )
    else:
        advice.append("load in DataLoader worker processes (num_workers >= 2) with persistent_workers=True.")
    advice += [
        "read a packed format (tar shards: gk.data.write_shards / ShardLoader) or a decoded uint8 array "
        "(gk.data.write_array) instead of many small files.",
        "decode and augment on the GPU, in batches (torchvision.io.decode_jpeg(device='cuda'), transforms.v2 on "
        "batched tensors).",
        "keep the whole dataset on the device when it fits (gk.data.DeviceLoader): no per-batch host work at all.",
    ]
    return advice


def diagnose(
    loader: Iterable,
    model: nn.Module,
    *,
    steps: int = 20,
    warmup: int = 2,
    device: str | torch.device | None = None,
    precision: str | Precision = "fp32",
    loss_fn: str | Callable | None = None,
    optimizer: Callable[[Iterable], torch.optim.Optimizer] | None = None,
) -> Diagnosis:
    """Time the loader alone, the training step alone and both together, and say which is the bottleneck.

    loader: anything that yields batches of a form gpukit.step accepts (a DataLoader, a DeviceLoader, a
        list of batches, a ShardLoader). Each measurement reads `warmup + steps` batches, starting the
        loader again if it is shorter. The warm-up batches (worker start-up) are not timed.
    model: trained on a copy (an SGD step with a small learning rate unless `optimizer` builds another),
        so your model and its gradients are left as they were.
    On CUDA, PROFILED_STEPS more steps of the step alone run under torch.profiler, whose kernel times give
    `kernel_share`; with `host_share` they say whether the step is launch-bound (step_bound).
    """
    check_int("steps", steps, note="(batches timed per measurement)")
    check_int("warmup", warmup, minimum=0, note="(untimed batches first)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module, got {type(model).__name__}.")
    device = resolve_device(device)
    precision = get_precision(precision, device)
    trained = copy.deepcopy(model).to(device).train()
    built = optimizer(trained.parameters()) if optimizer else torch.optim.SGD(trained.parameters(), lr=1e-3)
    train_step = TrainStep(trained, built, precision, Loss(loss_fn))

    # 1. The loader alone: produce each batch and copy it to the device.
    seconds, first, on_host = _time_loader(loader, device, warmup, steps)
    loader_rate = steps / seconds

    with precision.flags():
        # 2. The step alone, on one batch already on the device: what the step could do if data were free.
        step_rate, kernel_share, host_share = _time_step_alone(train_step, first, device, warmup, steps)

        # 3. Both together, as fit runs them (host batches copied one step ahead on CUDA: gk.data.prefetch);
        # time blocked waiting for the next batch counts as data wait.
        waited, started = 0.0, time.perf_counter()
        batches = _cycle(prefetch(loader, device) if on_host else loader, warmup + steps)
        for index in range(warmup + steps):
            if index == warmup:
                synchronize(device)
                waited, started = 0.0, time.perf_counter()
            before = time.perf_counter()
            batch = _on_device(next(batches), device)
            waited += time.perf_counter() - before
            train_step(batch)
        synchronize(device)
        elapsed = time.perf_counter() - started
    together_rate = steps / elapsed
    diagnosis = Diagnosis(
        loader_steps_per_second=loader_rate,
        step_steps_per_second=step_rate,
        together_steps_per_second=together_rate,
        data_wait_fraction=min(waited / elapsed, 1.0),
        batch_size=first.size,
        steps=steps,
        device=str(device),
        kernel_share=kernel_share,
        host_share=host_share,
    )
    diagnosis.advice = _advice(loader, device, diagnosis.input_bound, diagnosis.verdict == "launch-bound")
    return diagnosis


def _time_step_alone(
    train_step: TrainStep, batch: Batch, device: torch.device, warmup: int, steps: int
) -> tuple[float, float | None, float | None]:
    """(steps per second, kernel share, host share) of the step repeated on one resident batch; the shares
    (see step_bound) on CUDA only, None elsewhere or where the profiler saw no kernel."""
    for _ in range(warmup):
        train_step(batch)
    synchronize(device)
    launching, started = 0.0, time.perf_counter()
    for _ in range(steps):
        before = time.perf_counter()
        train_step(batch)
        launching += time.perf_counter() - before  # in the step's calls: launching (or blocked on the GPU)
    synchronize(device)
    elapsed = time.perf_counter() - started
    if device.type != "cuda":
        return steps / elapsed, None, None
    # The kernels' busy time per step, from a few more steps under the profiler (the GPU's own clock), over the
    # wall time per step measured above without it (the profiler slows the host's launches).
    calls = min(steps, PROFILED_STEPS)
    busy = kernel_seconds(lambda: train_step(batch), calls, device)
    kernel_share = None if busy is None else min(1.0, (busy / calls) / (elapsed / steps))
    return steps / elapsed, kernel_share, None if busy is None else min(1.0, launching / elapsed)
