"""All-reduce benchmark: time, algorithm bandwidth and bus bandwidth by message size.

    python benchmarks/allreduce.py                          # every GPU (NCCL), or 2 CPU processes (gloo)
    python benchmarks/allreduce.py --nprocs 4 --backend gloo --max-bytes 67108864
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
    args = parser.parse_args()
    sizes = [2**k for k in range(args.min_bytes.bit_length() - 1, args.max_bytes.bit_length())]
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one of the ranks
        result = measure(sizes, args.repeats)
        if int(os.environ["RANK"]) != 0:
            return
    else:
        result = gk.distributed.launch(measure, args.nprocs, sizes, args.repeats, backend=args.backend)[0]
    world_size = result["world_size"]
    print(gk.Table(result["rows"], title=f"all_reduce of float32 over {world_size} ranks ({result['backend']})"))
    bandwidth, latency = scaling.fit_link(result["rows"], world_size)
    print(
        f"\nring model fit: bandwidth {bandwidth / 1e9:.2f} GB/s per link, latency {latency * 1e6:.1f} µs per ring step"
    )
    print(f"{result['device']}, torch {torch.__version__}, {datetime.date.today()}")


if __name__ == "__main__":
    main()
