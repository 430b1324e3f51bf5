"""A straggler sets the pace: synchronous data parallelism waits for the slowest rank at every all-reduce.

Each step, every rank computes, then all ranks all-reduce their gradients: no rank can go on until the
slowest has arrived. One slow rank (a throttled GPU, a busy host, a noisy neighbour) makes every rank slow.

    schedule(world_size, steps, pattern, seed)   which rank is slow at each step:
        "none"; "one": rank 1 at every step (a slower GPU); "random": one rank drawn at each step (jitter)
    predict(slow, compute, delay, sync_every)    the cost model: each synchronisation waits for the rank with the
                                                 most work since the last one, so a run takes the sum over
                                                 synchronisation windows of the largest per-rank work in each
    measure(variants, world_size, ...)           the same runs on real processes (gloo all-reduces), timed

`sync_every=H > 1` is local SGD: ranks step on their own and average parameters every H steps. It forgives
jitter (a rank slow at one step catches up at the next) but not a rank that is always slow. The "compute" is a
sleep: waiting is what is measured here, and a sleep keeps a busy machine's load out of the result; the
all-reduce, the waiting and the processes are real.
"""

from __future__ import annotations

import random
import time

import torch
import torch.distributed as dist

from .launcher import launch
from .parallel import cleanup, setup

PATTERNS = ("none", "one", "random")


def schedule(world_size: int, steps: int, pattern: str, seed: int = 0) -> list[int | None]:
    """The slow rank at each step (None: no rank is slow)."""
    if pattern not in PATTERNS:
        raise ValueError(f"pattern={pattern!r} is unknown; use one of {', '.join(PATTERNS)}.")
    if world_size < 2 or steps < 1:
        raise ValueError(f"a straggler needs world_size >= 2 and steps >= 1, got {world_size} and {steps}.")
    draw = random.Random(seed)
    return [{"none": None, "one": 1, "random": draw.randrange(world_size)}[pattern] for _ in range(steps)]


def predict(slow: list[int | None], world_size: int, compute: float, delay: float, sync_every: int = 1) -> float:
    """Seconds the run takes by the cost model (communication left out): per synchronisation window, the work
    of the rank that has the most."""
    total = 0.0
    for start in range(0, len(slow), sync_every):
        window = slow[start : start + sync_every]
        total += max(len(window) * compute + delay * window.count(rank) for rank in range(world_size))
    return total


def _worker(variants: dict[str, tuple[list, int]], compute: float, delay: float) -> dict[str, float]:
    worker = setup(backend="gloo")  # CPU processes: the waiting, not the device, is measured
    parameters = torch.zeros(1024)  # what the all-reduce averages: gradients, or local SGD's parameters
    dist.all_reduce(parameters)  # warm-up: gloo's first all-reduce sets up its pairs (~0.4 s measured under load)
    seconds = {}
    for name, (slow, sync_every) in variants.items():
        dist.barrier()
        started = time.perf_counter()
        for step, slow_rank in enumerate(slow):
            time.sleep(compute + (delay if slow_rank == worker.rank else 0.0))
            if (step + 1) % sync_every == 0 or step == len(slow) - 1:
                dist.all_reduce(parameters)
        dist.barrier()
        seconds[name] = time.perf_counter() - started
    cleanup()
    return seconds


def measure(
    variants: dict[str, tuple[list[int | None], int]],
    world_size: int,
    compute: float,
    delay: float,
    *,
    start_method: str = "spawn",
) -> dict[str, float]:
    """Run every variant, name -> (slow rank per step, sync_every), on `world_size` gloo processes, one after
    another in the same processes; returns rank 0's wall seconds for each. `start_method` as in `launch`: fork
    where `fastest_start_method()` says it is safe saves each rank's import of torch (~4.5 s of CPU here)."""
    for name, (slow, sync_every) in variants.items():
        if sync_every < 1 or not slow or any(rank is not None and not 0 <= rank < world_size for rank in slow):
            raise ValueError(f"variant {name!r}: sync_every must be >= 1 and each slow rank in 0..{world_size - 1}.")
    return launch(
        _worker, world_size, variants, compute, delay, backend="gloo", start_method=start_method, timeout=600
    )[0]
