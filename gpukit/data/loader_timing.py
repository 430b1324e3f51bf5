"""How fast a loader delivers batches, and the DataLoader worker settings that change it.

`loader_rate` times a loader alone: batches produced and copied to the device, per second, after a warm-up (worker
start-up) that is not timed; gk.data.diagnose times the loader the same way. `sweep(dataset, batch_size)` measures a
DataLoader's rate over a grid of `num_workers` × `prefetch_factor`; `plot_sweep` draws it. `check_workers` refuses
worker settings that cannot work and warns about ones that oversubscribe the CPU (every loader gpukit builds calls
it). `SlowDataset` waits before each sample without using the CPU, as slow storage does, so that what workers hide
shows on any machine.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Iterable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ..env import resolve_device, synchronize
from ..report import Table
from ..step import Batch, split_batch, to_device
from ..validation import check_int


def check_workers(num_workers: int, prefetch_factor: int | None) -> None:
    """Reject DataLoader worker settings that cannot work; warn about ones that oversubscribe the CPU."""
    check_int("num_workers", num_workers, minimum=0, note="(0: load in the training process)")
    if prefetch_factor is not None and num_workers == 0:
        raise ValueError(
            f"prefetch_factor={prefetch_factor} applies to worker processes (batches each worker loads ahead), but "
            "num_workers=0; set num_workers >= 1 or leave prefetch_factor=None."
        )
    if prefetch_factor is not None and (not isinstance(prefetch_factor, int) or prefetch_factor < 1):
        raise ValueError(f"prefetch_factor must be a positive integer, got {prefetch_factor!r}.")
    cores = os.cpu_count() or 1
    if num_workers > cores:
        warnings.warn(
            f"num_workers={num_workers} is more than the {cores} CPU cores here: the workers and the training process "
            f"compete for cores and loading gets slower, not faster; try num_workers <= {cores}.",
            stacklevel=3,
        )


class SlowDataset(Dataset):
    """`dataset` with a wait of `seconds` before each sample: storage latency (a network disk, a cold
    cache) made visible on purpose. The wait uses no CPU, so worker processes overlap it even on a
    machine whose cores are busy."""

    def __init__(self, dataset: Dataset, seconds: float):
        if seconds < 0:
            raise ValueError(f"seconds must be >= 0, got {seconds!r}.")
        self.dataset, self.seconds = dataset, seconds

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index):
        time.sleep(self.seconds)
        return self.dataset[index]


# ---------------------------------------------------------------------------------------------
# A loader alone, timed


def _on_device(raw, device: torch.device) -> Batch:
    return to_device(split_batch(raw), device)


def _cycle(loader: Iterable, count: int) -> Iterator:
    """`count` raw batches, starting the loader again when it runs out (a short loader is read several times)."""
    produced = 0
    while produced < count:
        empty = True
        for raw in loader:
            empty = False
            yield raw
            produced += 1
            if produced == count:
                return
        if empty:
            raise ValueError(
                f"the loader (a {type(loader).__name__}) yielded no batch{' on a second pass' if produced else ''}: "
                "check that its dataset is not empty and that batch_size with drop_last leaves a batch, and pass a "
                "re-iterable (a list, a Dataset's loader), not a used-up generator."
            )


def _time_loader(loader: Iterable, device: torch.device, warmup: int, steps: int) -> tuple[float, Batch, bool]:
    """(seconds for `steps` batches after `warmup` ones, the first batch on the device, whether the loader
    yields batches in host memory)."""
    first, on_host, started = None, False, time.perf_counter()
    batches = _cycle(loader, warmup + steps)
    for index in range(warmup + steps):
        if index == warmup:  # the clock starts before batch `warmup` is asked for: `steps` batches timed, no fewer
            synchronize(device)
            started = time.perf_counter()
        raw = next(batches)
        if first is None:
            on_host = any(not tensor.is_cuda for tensor in split_batch(raw).tensors())
        batch = _on_device(raw, device)
        first = batch if first is None else first
    synchronize(device)
    return time.perf_counter() - started, first, on_host


def loader_rate(loader: Iterable, batches: int, device: str | torch.device = "cpu", warmup: int = 1) -> float:
    """Batches per second a loader delivers to `device`, after `warmup` batches (worker start-up excluded)."""
    device = resolve_device(device)
    seconds, _, _ = _time_loader(loader, device, warmup, batches)
    return batches / seconds


# ---------------------------------------------------------------------------------------------
# Sweep over DataLoader settings


def sweep(
    dataset: Dataset,
    batch_size: int,
    *,
    num_workers: Sequence[int] = (0, 1, 2),
    prefetch_factor: Sequence[int] = (2, 4),
    batches: int = 10,
    rounds: int = 4,
    device: str | torch.device = "cpu",
    **loader_options,
) -> Table:
    """Batches and samples per second of a DataLoader over `num_workers` × `prefetch_factor`.

    With 0 workers prefetch_factor does not apply: one row, prefetch_factor None. Every setting's DataLoader is
    built first (persistent workers), then timed in `rounds` interleaved rounds, the settings' order reversed every
    other round, so that load from other programs that changes over time falls on every setting alike (over an even
    number of rounds a linear drift cancels). A round times one setting as `loader_rate` does: a new epoch, its first batch untimed (in the first
    round that wait holds the workers' start-up; later, the batches its workers prefetched while the other settings
    ran are dropped when the epoch restarts), then `batches` batches timed. A row's rate is all its rounds' batches
    over all their seconds. `loader_options` go to DataLoader.
    """
    check_int("batches", batches, minimum=1)
    check_int("rounds", rounds, minimum=1, note="(interleaved rounds of every setting)")
    for workers in num_workers:
        check_workers(workers, None)
    settings = [
        (workers, factor) for workers in num_workers for factor in ((None,) if workers == 0 else prefetch_factor)
    ]
    for workers, factor in settings:
        check_workers(workers, factor)
    device = resolve_device(device)
    loaders = [
        DataLoader(
            dataset,
            batch_size=batch_size,
            num_workers=workers,
            prefetch_factor=factor,
            persistent_workers=workers > 0,
            **loader_options,
        )
        for workers, factor in settings
    ]
    seconds = [0.0] * len(settings)
    try:
        for round_ in range(rounds):
            order = range(len(settings)) if round_ % 2 == 0 else reversed(range(len(settings)))
            for index in order:
                seconds[index] += _time_loader(loaders[index], device, 1, batches)[0]
    finally:
        loaders.clear()  # ends every setting's workers
    rows = []
    for (workers, factor), total in zip(settings, seconds):
        rate = rounds * batches / total
        rows.append(
            {
                "num_workers": workers,
                "prefetch_factor": factor,
                "batches_per_second": rate,
                "samples_per_second": rate * batch_size,
            }
        )
    return Table(
        rows,
        title=f"DataLoader throughput, batch size {batch_size}",
        notes=[f"each setting timed over {rounds} rounds of {batches} batches, the settings' rounds interleaved"],
    )


def plot_sweep(table: Table, title: str = "DataLoader throughput"):
    """samples/s against num_workers, one line per prefetch_factor."""
    from ..figures import subplots

    figure, axes = subplots(figsize=(5, 3.5))
    rows = table.rows
    factors = sorted({row["prefetch_factor"] for row in rows if row["prefetch_factor"] is not None})
    baseline = [row for row in rows if row["prefetch_factor"] is None]
    for factor in factors:
        line = baseline + [row for row in rows if row["prefetch_factor"] == factor]
        axes.plot(
            [row["num_workers"] for row in line],
            [row["samples_per_second"] for row in line],
            marker="o",
            label=f"prefetch_factor={factor}",
        )
    if not factors:
        axes.plot([row["num_workers"] for row in rows], [row["samples_per_second"] for row in rows], marker="o")
    axes.set_xlabel("num_workers")
    axes.set_ylabel("samples / s")
    axes.set_title(title)
    axes.set_ylim(bottom=0)
    if factors:
        axes.legend()
    figure.tight_layout()
    return figure
