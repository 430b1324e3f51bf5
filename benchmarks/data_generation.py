"""How fast is the synthetic dataset made? (gk.data.shapes: the lessons and tests build it on every run.)

Median seconds of `shapes(n, 0)` over a few repeats for growing n, and images per second. Moved here
from the unit tests, where a wall-clock bound flakes on a loaded machine. The images are always made on
the CPU; with `--device cuda` each row also gives the median seconds to copy them to the GPU.

    python benchmarks/data_generation.py
    python benchmarks/data_generation.py --device cuda --json shapes.json

Target: 20,000 images in well under 10 s on a 2-core CPU (the lessons' `tiny` profile builds 8,192).
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import torch

import gpukit as gk
from gpukit.bench import synchronize
from gpukit.report import save_tables


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000, 8_192, 20_000])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", help="cpu, or cuda to also time the copy to the GPU")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    device = gk.resolve_device(args.device)
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
        f"{datetime.date.today()}"
    )
    torch.zeros(1, device=device)  # initialise the device (CUDA: seconds) before anything is timed
    rows = []
    for size in args.sizes:
        seconds, copy_seconds = [], []
        for _ in range(args.repeats):
            started = time.perf_counter()
            train, _ = gk.data.shapes(size, 0)
            seconds.append(time.perf_counter() - started)
            if device.type != "cpu":
                started = time.perf_counter()
                train.images.to(device)
                synchronize(device)
                copy_seconds.append(time.perf_counter() - started)
        median = statistics.median(seconds)
        rows.append({"images": size, "median s": median, "images/s": size / median, "slowest s": max(seconds)})
        if copy_seconds:
            rows[-1][f"copy to {device.type} s"] = statistics.median(copy_seconds)
    table = gk.Table(rows, title="gk.data.shapes(n, 0)")
    print(table)
    if args.json:
        save_tables(args.json, [table], device=str(device), repeats=args.repeats)


if __name__ == "__main__":
    main()
