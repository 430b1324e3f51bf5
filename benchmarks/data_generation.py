"""How fast is the synthetic dataset made? (gk.data.shapes: the lessons and tests build it on every run.)

Median seconds of `shapes(n, 0)` over a few repeats for growing n, and images per second. Moved here
from the unit tests, where a wall-clock bound flakes on a loaded machine.

    python benchmarks/data_generation.py

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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2_000, 8_192, 20_000])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}, "
          f"{datetime.date.today()}")  # fmt: skip
    rows = []
    for size in args.sizes:
        seconds = []
        for _ in range(args.repeats):
            started = time.perf_counter()
            gk.data.shapes(size, 0)
            seconds.append(time.perf_counter() - started)
        median = statistics.median(seconds)
        rows.append({"images": size, "median s": median, "images/s": size / median, "slowest s": max(seconds)})
    print(gk.Table(rows, title="gk.data.shapes(n, 0)"))


if __name__ == "__main__":
    main()
