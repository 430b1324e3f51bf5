"""All-reduce benchmark: time, algorithm bandwidth and bus bandwidth by message size.

    python benchmarks/allreduce.py                          # every GPU (NCCL), or 2 CPU processes (gloo)
    python benchmarks/allreduce.py --nprocs 4 --backend gloo --max-bytes 67108864
    python benchmarks/allreduce.py --device cuda --json allreduce.json   # says "skipped" with fewer than 2 GPUs
    torchrun --nproc-per-node=8 benchmarks/allreduce.py     # the same measurement, started by torchrun

Bus bandwidth = algorithm bandwidth × 2(n−1)/n: what each link carried in a ring all-reduce, the
figure NVIDIA's nccl-tests print and the one to compare with a link's datasheet speed. The script
also fits the ring model time = 2(n−1)·α + 2(n−1)/n · S/B to the rows (latency α, bandwidth B).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

import gpukit as gk
from gpukit.distributed import scaling
from gpukit.report import save_tables


def device_name(worker) -> str:
    return torch.cuda.get_device_name(worker.device) if worker.device.type == "cuda" else platform.processor() or "CPU"


def measure(sizes: list[int], repeats: int) -> dict:
    worker = gk.distributed.setup()
    rows = scaling.allreduce_benchmark(sizes, repeats=repeats)
    result = {"rows": rows, "world_size": worker.world_size, "backend": worker.backend, "device": device_name(worker)}
    gk.distributed.cleanup()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, help="processes (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with GPUs, else gloo")
    parser.add_argument("--min-bytes", type=int, default=2**10)
    parser.add_argument("--max-bytes", type=int, default=2**24)
    parser.add_argument("--repeats", type=int, default=10, help="timed all-reduces per size (median)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        help="cuda: one process per GPU over NCCL (2 GPUs or more); cpu: processes over gloo",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    try:
        backend, skipped = scaling.benchmark_backend(args.device, args.backend, args.nprocs)
    except ValueError as error:
        parser.error(str(error))
    if skipped and "WORLD_SIZE" not in os.environ:
        print(f"skipped: {skipped}")
        if args.json:
            save_tables(args.json, [], skipped=skipped)
        return
    sizes = [2**k for k in range(args.min_bytes.bit_length() - 1, args.max_bytes.bit_length())]
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one of the ranks
        result = measure(sizes, args.repeats)
        if int(os.environ["RANK"]) != 0:
            return
    else:
        result = gk.distributed.launch(measure, args.nprocs, sizes, args.repeats, backend=backend)[0]
    world_size = result["world_size"]
    table = gk.Table(result["rows"], title=f"all_reduce of float32 over {world_size} ranks ({result['backend']})")
    print(table)
    bandwidth, latency = scaling.fit_link(result["rows"], world_size)
    print(
        f"\nring model fit: bandwidth {bandwidth / 1e9:.2f} GB/s per link, latency {latency * 1e6:.1f} µs per ring step"
    )
    print(f"{result['device']}, torch {torch.__version__}, {datetime.date.today()}")
    if args.json:
        save_tables(
            args.json,
            [table],
            device=result["device"],
            world_size=world_size,
            link_bandwidth_GBps=bandwidth / 1e9,
            latency_us_per_ring_step=latency * 1e6,
        )


if __name__ == "__main__":
    main()
