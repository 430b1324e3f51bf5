"""What does a running gk.hardware.Monitor cost a training step?

The monitor samples NVML (power, utilisation, clocks, temperature, memory) from a thread, ten times a
second by default. This times blocks of training steps with the monitor running and without it,
interleaved (without, with, without, …) so that drift in clocks and load hits both alike. The monitor
is started before and stopped after each "with" block, outside the timed region: what is timed is the
cost of sampling while steps run, not of starting a thread. Each block lasts about `--block-seconds`,
so it holds several samples.

    python benchmarks/monitor_overhead.py --device cuda                # the fast CNN, width 64, batch 512
    python benchmarks/monitor_overhead.py --device cuda --json monitor.json

Target: the ratio of median block times (with ÷ without) below 1.02. Without NVML (no NVIDIA GPU, or
no nvidia-ml-py) there is nothing to sample from a thread, and the script says "skipped".
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gpukit as gk
from gpukit.bench import synchronize
from gpukit.report import save_tables


def timed_block(step, batch, steps: int, device: torch.device) -> float:
    synchronize(device)
    started = time.perf_counter()
    for _ in range(steps):
        step(batch)
    synchronize(device)
    return time.perf_counter() - started


def measure(args, device: torch.device, monitor) -> dict:
    model = gk.models.fast_cnn(args.width).to(device)
    step = gk.step.TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), args.precision, device=device)
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (args.batch_size,), generator=generator)
    batch = (images.to(device), labels.to(device))
    for _ in range(5):  # warm-up: cuDNN's algorithm choice, the allocator's first blocks
        step(batch)
    one_step = timed_block(step, batch, 10, device) / 10
    steps = max(10, round(args.block_seconds / one_step))
    without, with_monitor, samples = [], [], 0
    for _ in range(args.rounds):
        without.append(timed_block(step, batch, steps, device))
        before = len(monitor.samples)
        monitor.start()
        with_monitor.append(timed_block(step, batch, steps, device))
        monitor.stop()
        samples += len(monitor.samples) - before
    return {
        "steps_per_block": steps,
        "step_ms": statistics.median(without) / steps * 1e3,
        "ratio": statistics.median(with_monitor) / statistics.median(without),
        "samples_per_block": samples / args.rounds,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--precision", default="bf16-mixed")
    parser.add_argument("--block-seconds", type=float, default=1.0, help="each timed block's length")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved pairs of blocks")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON")
    args = parser.parse_args()
    device = gk.resolve_device(args.device)
    monitor = gk.hardware.Monitor(device)
    if device.type != "cuda" or not monitor.available:  # only NVML samples from a thread: nothing to measure
        skipped = f"the monitor samples from a thread only on a CUDA GPU with NVML ({monitor.reason or device})"
        print(f"skipped: {skipped}")
        if args.json:
            save_tables(args.json, [], skipped=skipped)
        return
    try:
        result = measure(args, device, monitor)
    finally:
        monitor.close()
    row = {"model": f"fast_cnn({args.width})", "batch": args.batch_size, "precision": args.precision, **result}
    row["overhead_percent"] = (row["ratio"] - 1) * 100
    row["below_2_percent"] = "yes" if row["ratio"] < 1.02 else "no"
    table = gk.Table([row], title=f"a running Monitor (every {monitor.interval:g} s) against none, interleaved")
    print(table)
    if args.json:
        save_tables(args.json, [table], device=str(device), rounds=args.rounds)


if __name__ == "__main__":
    main()
