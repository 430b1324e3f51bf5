"""Measurements of what data parallelism costs, run inside launched workers (every rank calls
each function, as with any collective):

- `ring_traffic`: the bytes each rank sends per byte a ring all-reduces, 2(n−1)/n;
- `allreduce_benchmark`: time, algorithm bandwidth and bus bandwidth of all_reduce by message size;
- `throughput_by_workers`: training throughput with 1..N workers and the scaling efficiency;
- `ddp_variants`: the same DDP step with other bucket sizes, gradient compression, or no all-reduce;
- `compare_parallelism`: DDP vs FSDP2 vs a two-stage pipeline: state bytes per rank and step time.

`benchmark_backend` (called in the parent, before launching) turns a benchmark's --device into a backend.

Timings are the slowest rank's median (a step is as slow as its slowest rank); `ddp_variants` takes the slowest
rank of each repeat, and reports the median's standard error beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from functools import partial

import torch
import torch.distributed as dist
from torch import nn

from ..bench import Timing, compare, timeit
from ..env import detect
from ..precision import get_precision
from ..step import TrainStep
from . import parallel
from .collectives import count_collectives
from .pipeline import TwoStagePipeline


def ring_traffic(world_size: int) -> float:
    """Bytes each rank sends (and receives) per byte all-reduced by a ring over `world_size` ranks: 2(n−1)/n.

    A ring all-reduce of S bytes cuts them into n pieces and goes around the ring twice, n − 1 hops each time:
    once to add up the pieces (reduce-scatter), once to hand the sums out (all-gather). Each hop a rank sends
    one piece, S/n bytes. 1 for 2 ranks, 4/3 for 3, approaching 2 for many; 0 for one rank, which sends nothing.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be 1 or more, got {world_size}.")
    return 2 * (world_size - 1) / world_size


def bus_bandwidth(algorithm_bandwidth: float, world_size: int) -> float:
    """Bus bandwidth of an all-reduce: algorithm bandwidth × 2(n−1)/n (`ring_traffic`).

    Bus bandwidth is the rate each link actually carried, comparable across world sizes and with
    the hardware's link speed; algorithm bandwidth is simply S / time.
    """
    return algorithm_bandwidth * ring_traffic(world_size)


def benchmark_backend(
    device: str | None, backend: str | None = None, nprocs: int | None = None
) -> tuple[str, str | None]:
    """(backend, why the benchmark cannot run here or None) for a measurement across ranks on `device`.

    device "cuda": NCCL, one process per GPU; "cpu": gloo processes; None: `backend`, else NCCL where there are
    GPUs. Every measurement here compares ranks, so fewer than 2 (one GPU, or nprocs=1) is a reason to skip.
    Asks NVML (gk.detect), so the parent process never initialises CUDA before it launches the workers.
    """
    if device not in (None, "cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported here; use 'cuda' (NCCL) or 'cpu' (gloo).")
    gpus = detect().gpu_count
    default = backend or ("nccl" if gpus else "gloo")
    wanted = {"cuda": "nccl", "cpu": "gloo", None: default}[device]
    if backend not in (None, wanted):
        raise ValueError(f"device {device} runs over {wanted}, not backend {backend}; leave one of the two out.")
    if nprocs is not None and nprocs < 2:
        return wanted, f"needs 2 or more ranks, and nprocs={nprocs}"
    if nprocs is None and wanted == "nccl" and gpus < 2:
        return wanted, f"needs 2 or more ranks, one per CUDA GPU, and this machine has {gpus} GPU(s)"
    return wanted, None


def _slowest(seconds: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest value over ranks (a step is as slow as its slowest rank)."""
    value = torch.tensor([seconds], dtype=torch.float64, device=parallel.default_device() or "cpu")
    dist.all_reduce(value, op=dist.ReduceOp.MAX, group=group)
    return float(value.item())


def _slowest_each(seconds: Sequence[float]) -> list[float]:
    """For each repeat, the largest value over ranks (that repeat's step took as long as its slowest rank)."""
    values = torch.tensor(list(seconds), dtype=torch.float64, device=parallel.default_device() or "cpu")
    dist.all_reduce(values, op=dist.ReduceOp.MAX)
    return values.tolist()


def allreduce_benchmark(sizes: Sequence[int], *, repeats: int = 10, warmup: int = 3) -> list[dict]:
    """all_reduce of float32 messages of each size (bytes): median seconds and bandwidths (GB/s)."""
    device = parallel.default_device() or torch.device("cpu")
    count = parallel.world_size()
    rows = []
    for size in sizes:
        message = torch.zeros(max(size // 4, 1), device=device)  # zeros: sums stay finite however often repeated

        def once(message=message):
            dist.all_reduce(message)

        parallel.barrier()  # start together, or the first call measures waiting for the others
        seconds = _slowest(timeit(once, device=device, warmup=warmup, repeats=repeats).median)
        algorithm = message.nbytes / seconds
        rows.append(
            {
                "bytes": message.nbytes,
                "seconds": seconds,
                "algorithm_GBps": algorithm / 1e9,
                "bus_GBps": bus_bandwidth(algorithm, count) / 1e9,
            }
        )
    return rows


def fit_link(rows: Sequence[dict], world_size: int) -> tuple[float, float]:
    """Bandwidth (bytes/s) and latency (s per ring step) that best explain benchmark rows.

    A ring all-reduce takes 2(n−1) steps, each paying a latency α, and moves 2(n−1)/n · S bytes
    through each link of bandwidth B: time = 2(n−1)·α + 2(n−1)/n · S/B. A least-squares line
    time = a + b·S through the rows gives α = a / (2(n−1)) and B = 2(n−1) / (n·b).
    """
    if world_size < 2 or len(rows) < 2:
        raise ValueError("fit_link needs rows measured with at least 2 ranks and 2 message sizes.")
    sizes = [row["bytes"] for row in rows]
    times = [row["seconds"] for row in rows]
    mean_size, mean_time = sum(sizes) / len(sizes), sum(times) / len(times)
    slope = sum((s - mean_size) * (t - mean_time) for s, t in zip(sizes, times)) / sum(
        (s - mean_size) ** 2 for s in sizes
    )
    intercept = mean_time - slope * mean_size
    steps = 2 * (world_size - 1)
    bandwidth = steps / (world_size * slope) if slope > 0 else math.inf
    latency = max(intercept, min(times) / 10) / steps  # a negative intercept is noise: keep it small and positive
    return bandwidth, latency


# ---------------------------------------------------------------------------------------------
# Training steps


def _synthetic_batch(
    batch_size: int, device: torch.device, of_rank: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random 32×32 images and labels, different on each rank (or those of rank `of_rank`)."""
    generator = torch.Generator().manual_seed(1000 + (parallel.rank() if of_rank is None else of_rank))
    images = torch.randn(batch_size, 3, 32, 32, generator=generator).to(device)
    labels = torch.randint(0, 10, (batch_size,), generator=generator).to(device)
    return images, labels


def _step_function(
    model: nn.Module, optimizer: torch.optim.Optimizer, images, labels, no_sync: bool = False
) -> Callable:
    """fit's training step (gpukit.step.TrainStep) on one batch, in fp32.

    Gradients are zeroed in place, not freed, so that they stay to be counted after a step."""
    step = TrainStep(model, optimizer, get_precision("fp32", images.device), set_to_none=False)

    def run():
        with parallel.no_sync(model, no_sync):
            step((images, labels))

    return run


def _optimizer(parameters) -> torch.optim.Optimizer:
    return torch.optim.SGD(parameters, lr=0.01, momentum=0.9)  # momentum: state as large as the parameters


def gradient_bytes(model: nn.Module) -> int:
    """Bytes of gradient one data-parallel step all-reduces (float32, every trainable parameter)."""
    return sum(p.numel() * 4 for p in model.parameters() if p.requires_grad)


def throughput_by_workers(
    make_model: Callable[[], nn.Module],
    batch_size: int,
    *,
    world_sizes: Sequence[int] | None = None,
    steps: int = 10,
    warmup: int = 2,
) -> list[dict]:
    """Training throughput with n = 1..N workers, each with its own `batch_size` (weak scaling).

    For each n, ranks 0..n-1 train a DDP model in their own process group (n = 1 is plain
    training, the baseline) while the others wait. Efficiency = throughput(n) / (n · throughput(1)):
    1.0 means n workers do n times the work of one.
    """
    device = parallel.default_device() or torch.device("cpu")
    world_sizes = list(world_sizes or range(1, parallel.world_size() + 1))
    images, labels = _synthetic_batch(batch_size, device)
    rows = []
    for count in world_sizes:
        # new_group must be called by every rank, in the same order, members or not.
        group = dist.new_group(list(range(count))) if 1 < count < parallel.world_size() else None
        seconds = 0.0
        if parallel.rank() < count:
            torch.manual_seed(0)
            model = make_model().to(device)
            if count > 1:
                model = parallel.data_parallel(model, process_group=group)
            step = _step_function(model, _optimizer(model.parameters()), images, labels)
            seconds = timeit(step, device=device, warmup=warmup, repeats=steps).median
        seconds = _slowest(seconds)  # idle ranks contribute 0
        rows.append({"workers": count, "step_time": seconds, "images_per_second": count * batch_size / seconds})
    single = next((row["images_per_second"] for row in rows if row["workers"] == 1), None)
    for row in rows:
        row["efficiency"] = row["images_per_second"] / (row["workers"] * single) if single else None
    return rows


def ddp_variants(
    make_model: Callable[[], nn.Module],
    batch_size: int,
    variants: dict[str, dict],
    *,
    steps: int = 10,
    warmup: int = 2,
) -> list[dict]:
    """The same DDP training step over all ranks, once per variant, timed interleaved.

    A variant is a dict of `data_parallel` options (`bucket_cap_mb`, `compression`) and
    optionally `no_sync=True`, which skips the all-reduce: compute alone, the lower bound.
    The variants take turns step by step (A, B, C, A, B, C, …), so that changes in the
    machine's load during the measurement hit all of them alike.
    Rows: variant, step_time (s: the median over repeats of the slowest rank's time), step_time_error (s: that
    median's standard error, from the spread of the repeats, `Timing.median_error`), images_per_second (all ranks),
    wire_bytes (per rank and step, 2(n−1)/n × the gradient bytes, halved by 16-bit compression, 0 without all-reduce),
    allreduced_bytes (the bytes rank 0 handed to all-reduce in one untimed step, counted at torch's dispatcher by
    `count_collectives`: what wire_bytes's arithmetic should be fed, counted rather than computed).
    """
    device = parallel.default_device() or torch.device("cpu")
    images, labels = _synthetic_batch(batch_size, device)
    count = parallel.world_size()
    steps_by_name, wire, counted = {}, {}, {}
    for name, options in variants.items():
        options = dict(options)
        skip = options.pop("no_sync", False)
        torch.manual_seed(0)
        model = parallel.data_parallel(make_model().to(device), **options)
        steps_by_name[name] = _step_function(model, _optimizer(model.parameters()), images, labels, no_sync=skip)
        wire[name] = 0 if skip else gradient_bytes(model) * ring_traffic(count)
        if options.get("compression"):
            wire[name] /= 2  # 16-bit instead of 32-bit gradients
        with count_collectives() as sent:  # one step, untimed: the dispatcher's count of what it all-reduces
            steps_by_name[name]()
        counted[name] = sent.bytes("allreduce")
    timings = compare(steps_by_name, device=device, warmup=warmup, repeats=steps)  # every rank, same order
    rows = []
    for name, timing in timings.items():
        slowest = Timing(_slowest_each(timing.times))
        rows.append(
            {
                "variant": name,
                "step_time": slowest.median,
                "step_time_error": slowest.median_error,
                "images_per_second": count * batch_size / slowest.median,
                "wire_bytes": wire[name],
                "allreduced_bytes": counted[name],
            }
        )
    return rows


def compare_parallelism(
    make_model: Callable[[], nn.Module],
    batch_size: int,
    *,
    steps: int = 5,
    warmup: int = 2,
    micro_batches: int = 4,
) -> list[dict]:
    """DDP, FSDP2 and a two-stage pipeline on the same model: what each rank holds, and step time.

    DDP and FSDP2 run on all ranks with `batch_size` images each; the pipeline runs on ranks 0
    and 1 with the same number of images per step as two DDP ranks (2 × batch_size, in
    `micro_batches` pieces). state_bytes: parameters + gradients + optimizer state on the
    rank that holds the most; peak_memory: CUDA bytes allocated at the peak (None on CPU).
    """

    device = parallel.default_device() or torch.device("cpu")
    count = parallel.world_size()
    if count < 2:
        raise RuntimeError("compare_parallelism needs at least 2 ranks: start it with gk.parallel.launch(fn, 2).")
    images, labels = _synthetic_batch(batch_size, device)
    rows = []

    def measure(name: str, ranks: int, step: Callable | None, holder: Callable[[], dict] | None) -> None:
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        seconds, held = 0.0, 0
        if step is not None:
            seconds = timeit(step, device=device, warmup=warmup, repeats=steps).median
            held = holder()["total"]
        peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        seconds, held, peak = _slowest(seconds), _slowest(held), _slowest(peak)
        images_per_step = batch_size * (2 if name.startswith("pipeline") else ranks)
        rows.append(
            {
                "strategy": name,
                "ranks": ranks,
                "images_per_step": images_per_step,
                "step_time": seconds,
                "images_per_second": images_per_step / seconds,
                "state_bytes_per_rank": int(held),
                "peak_memory": int(peak) if device.type == "cuda" else None,
            }
        )

    torch.manual_seed(0)
    model = parallel.data_parallel(make_model().to(device))
    optimizer = _optimizer(model.parameters())
    measure(
        "DDP",
        count,
        _step_function(model, optimizer, images, labels),
        partial(parallel.state_bytes, model, optimizer),
    )

    torch.manual_seed(0)
    sharded = parallel.sharded_data_parallel(make_model().to(device))
    optimizer = _optimizer(sharded.parameters())
    measure(
        "FSDP2",
        count,
        _step_function(sharded, optimizer, images, labels),
        partial(parallel.state_bytes, sharded, optimizer),
    )

    torch.manual_seed(0)
    step = holder = None
    if parallel.rank() < 2:
        pipeline = TwoStagePipeline(make_model(), micro_batches=micro_batches, device=device)
        optimizer = _optimizer(pipeline.parameters())
        both_images, both_labels = _synthetic_batch(2 * batch_size, device, of_rank=0)  # both stages: one batch

        def step():
            optimizer.zero_grad(set_to_none=True)
            pipeline.step(both_images, both_labels)
            optimizer.step()

        def holder():
            return parallel.state_bytes(pipeline.stage, optimizer)

    measure(f"pipeline ({micro_batches} micro-batches)", 2, step, holder)
    return rows
