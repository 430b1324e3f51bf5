"""Contention, measured: two training processes sharing one device against each one alone.

On a GPU both processes train on the same GPU (time-sliced by the driver, as when a forgotten
notebook kernel or another user's job shares it). On a CPU the shared device is one core: both
processes are pinned to the same core with one thread each, so a process alone has the whole
"device", as on a GPU. (Two threads per process on two cores would also contend, but GNU OpenMP's
spinning threads then slow down far more than the sharing explains: 8× measured on a loaded
2-core machine.) Phases alternate (process 0 alone, process 1 alone, both together) over
several rounds, so that drift and other load on the machine hit every phase alike; the result
holds the median throughput of each process in each phase, and the median share of the wall clock
each process was given the CPU (its own CPU seconds over the phase's seconds: the kernel's count,
apart from the steps counted), which on one core predicts the slowdown.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .. import distributed, env
from ..bench import synchronize
from ..distributed import launch
from ..optim import make_optimizer
from ..plots import plot_bars
from ..precision import get_precision
from ..report import Table
from ..step import Loss, TrainStep, split_batch, to_device
from ..validation import check_int


@dataclass
class ContentionResult:
    """Median samples/s of each process alone and while both train at once."""

    alone: list[float]  # process 0, process 1, each training while the other waits
    shared: list[float]  # process 0, process 1, training at the same time
    device: str
    threads: int  # CPU threads per process
    rounds: int
    cores: list[int] | None = None  # the CPU cores both processes were pinned to; None on a GPU
    # Each process's CPU seconds over the phase's wall-clock seconds (median over rounds; 1.0: a core all its own),
    # alone and shared, as the kernel counted them (time.process_time): on a CPU, a step costs the same CPU time
    # alone or shared, so the slowdown is the share shared over the share alone.
    alone_cpu_share: list[float] | None = None
    shared_cpu_share: list[float] | None = None

    @property
    def alone_sum(self) -> float:
        """What two processes would reach together if sharing cost nothing."""
        return sum(self.alone)

    @property
    def shared_sum(self) -> float:
        return sum(self.shared)

    @property
    def slowdown(self) -> list[float]:
        """Each process's throughput shared over alone (1.0: no slowdown)."""
        return [shared / alone for shared, alone in zip(self.shared, self.alone)]

    @property
    def cpu_share_ratio(self) -> list[float] | None:
        """Each process's share of the CPU shared over its share alone: what `slowdown` should be where the steps
        run on the CPU (None where the shares were not measured)."""
        if self.alone_cpu_share is None or self.shared_cpu_share is None:
            return None
        return [shared / alone for shared, alone in zip(self.shared_cpu_share, self.alone_cpu_share)]

    def table(self) -> Table:
        rows = [
            {"process": rank, "alone samples/s": a, "shared samples/s": s, "shared / alone": s / a}
            for rank, (a, s) in enumerate(zip(self.alone, self.shared))
        ]
        rows.append(
            {
                "process": "both",
                "alone samples/s": self.alone_sum,
                "shared samples/s": self.shared_sum,
                "shared / alone": self.shared_sum / self.alone_sum,
            }
        )
        where = self.device if self.cores is None else f"CPU core {', '.join(map(str, self.cores))}"
        return Table(
            rows,
            title=f"two training processes sharing {where} ({self.threads} thread(s) each), "
            f"medians of {self.rounds} rounds",
        )

    def plot(self):
        values = {
            "0 alone": self.alone[0],
            "1 alone": self.alone[1],
            "sum of two alone": self.alone_sum,
            "0 shared": self.shared[0],
            "1 shared": self.shared[1],
            "both shared": self.shared_sum,
        }
        return plot_bars(values, ylabel="samples/s", title=f"contention on {self.device}")


def _worker(make_model, make_batch, steps, rounds, threads, cores, device_name, optimizer, precision):
    """One of the two processes: the same phases in the same order, held in step by barriers."""
    worker = distributed.setup()  # gloo: the barriers only; both processes use `device_name`
    if cores is not None:
        os.sched_setaffinity(0, cores)  # this process only, and it exits at the end
    torch.set_num_threads(threads)
    device = torch.device(device_name)
    model = make_model().to(device)
    step = TrainStep(
        model, make_optimizer(optimizer, model.parameters(), 1e-3, 0.0), get_precision(precision, device), Loss()
    )
    batch = to_device(split_batch(make_batch()), device)
    for _ in range(2):  # warm-up: allocator, cuDNN autotuning
        step(batch)
    synchronize(device)
    measured: dict[str, list[float]] = {"alone": [], "shared": [], "alone cpu": [], "shared cpu": []}
    for _ in range(rounds):
        for phase in ("alone 0", "alone 1", "shared"):
            distributed.barrier()  # the waiting process blocks here and uses no CPU
            if phase in ("shared", f"alone {worker.rank}"):
                started, cpu_started = time.perf_counter(), time.process_time()
                for _ in range(steps):
                    step(batch)
                synchronize(device)
                seconds, cpu_seconds = time.perf_counter() - started, time.process_time() - cpu_started
                measured[phase.split()[0]].append(batch.size * steps / seconds)
                measured[f"{phase.split()[0]} cpu"].append(cpu_seconds / seconds)
    distributed.barrier()
    distributed.cleanup()
    return {name: statistics.median(values) for name, values in measured.items()}


def measure_contention(
    make_model: Callable[[], torch.nn.Module],
    make_batch: Callable[[], object],
    *,
    steps: int = 10,
    rounds: int = 3,
    device: str | None = None,
    optimizer: str = "nesterov",
    precision: str = "fp32",
    timeout: float = 300,
) -> ContentionResult:
    """Throughput of two training processes on one device, each alone and both at once.

    make_model, make_batch: functions that build the model and one batch in each process (sent
        by value, so functions defined in a notebook work).
    steps: optimizer steps per phase; rounds: how often the three phases repeat (medians).
    device: "cuda" (both processes on GPU 0) or "cpu" (both pinned to one core, one thread
        each; where CPU affinity cannot be set, both use all cores); default a GPU when there is one.
    """
    for name, value in (("steps", steps), ("rounds", rounds)):
        check_int(name, value)
    if not callable(make_model) or not callable(make_batch):
        raise TypeError("make_model and make_batch must be functions that build the model and a batch.")

    if device is None:
        device = "cuda" if env.detect().gpu_count else "cpu"
    device_name = "cuda:0" if torch.device(device).type == "cuda" else "cpu"
    cores = threads = None
    if device_name == "cpu" and hasattr(os, "sched_setaffinity"):
        cores, threads = [min(os.sched_getaffinity(0))], 1
    elif device_name == "cpu":
        threads = os.cpu_count() or 1
    else:
        threads = 1  # the GPU does the work
    results = launch(
        _worker,
        2,
        make_model,
        make_batch,
        steps,
        rounds,
        threads,
        cores,
        device_name,
        optimizer,
        precision,
        backend="gloo",
        timeout=timeout,
    )
    return ContentionResult(
        alone=[result["alone"] for result in results],
        shared=[result["shared"] for result in results],
        device=device_name,
        threads=threads,
        rounds=rounds,
        cores=cores,
        alone_cpu_share=[result["alone cpu"] for result in results],
        shared_cpu_share=[result["shared cpu"] for result in results],
    )
