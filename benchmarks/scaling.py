"""Data-parallel scaling: throughput with 1..N workers, DDP's bucket size and gradient compression,
DDP vs FSDP2 vs a two-stage pipeline, and the cost model's prediction up to 512 GPUs.

    python benchmarks/scaling.py                             # every GPU (NCCL), or 2 CPU processes
    python benchmarks/scaling.py --width 64 --batch-size 256 --interconnect "400 Gb/s InfiniBand"
    python benchmarks/scaling.py --device cuda --json scaling.json   # says "skipped" with fewer than 2 GPUs
    torchrun --nproc-per-node=8 benchmarks/scaling.py        # the same, started by torchrun

Weak scaling: every worker keeps its batch, so n workers do n times the work per step; efficiency
= throughput(n) / (n × throughput(1)). On a CPU the workers share cores and memory bandwidth, so
the efficiency measured there says little about GPUs; the cost model's prediction uses the
measured compute time of one worker and the link fitted to an all-reduce benchmark.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform

import torch

import gpukit as gk
from gpukit.distributed import costmodel, scaling
from gpukit.report import save_tables


def device_name(worker) -> str:
    return torch.cuda.get_device_name(worker.device) if worker.device.type == "cuda" else platform.processor() or "CPU"


def measure(width: int, batch_size: int, steps: int) -> dict:
    worker = gk.distributed.setup()

    def make_model():
        return gk.models.fast_cnn(width)

    gradient_mib = scaling.gradient_bytes(make_model()) / 2**20
    variants = {
        "float32, 25 MiB buckets": {},
        f"float32, {gradient_mib / 8:.2g} MiB buckets": {"bucket_cap_mb": gradient_mib / 8},
        "fp16 compression": {"compression": "fp16"},
        "bf16 compression": {"compression": "bf16"},
        "no all-reduce (no_sync)": {"no_sync": True},
    }
    result = {
        "workers": scaling.throughput_by_workers(make_model, batch_size, steps=steps),
        "variants": scaling.ddp_variants(make_model, batch_size, variants, steps=steps),
        "parallelism": scaling.compare_parallelism(make_model, batch_size, steps=steps),
        "allreduce": scaling.allreduce_benchmark([2**k for k in range(10, 25, 2)], repeats=steps),
        "gradient_bytes": scaling.gradient_bytes(make_model()),
        "world_size": worker.world_size,
        "backend": worker.backend,
        "device": device_name(worker),
    }
    gk.distributed.cleanup()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nprocs", type=int, help="processes (default: one per GPU, or 2 on CPU)")
    parser.add_argument("--backend", choices=("nccl", "gloo"), help="default: nccl with GPUs, else gloo")
    parser.add_argument("--width", type=int, default=16, help="fast CNN width (default: 16)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per worker and step (default: 64)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per measurement (median)")
    parser.add_argument("--interconnect", default="100 Gb/s InfiniBand", choices=sorted(costmodel.INTERCONNECTS))
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
    if "WORLD_SIZE" in os.environ:  # started by torchrun: this process is one of the ranks
        result = measure(args.width, args.batch_size, args.steps)
        if int(os.environ["RANK"]) != 0:
            return
    else:
        ranks = gk.distributed.launch(measure, args.nprocs, args.width, args.batch_size, args.steps, backend=backend)
        result = ranks[0]
    count, backend = result["world_size"], result["backend"]
    title = f"fast CNN width {args.width}, batch {args.batch_size} per worker, {backend}"
    tables = [
        gk.Table(result["workers"], title=f"weak scaling: {title}"),
        gk.Table(result["variants"], title=f"DDP variants on {count} workers"),
        gk.Table(result["parallelism"], title=f"DDP vs FSDP2 vs pipeline on {count} workers"),
    ]
    print(*tables, sep="\n\n", end="\n\n")

    compute_time = result["workers"][0]["step_time"]
    bandwidth, latency = scaling.fit_link(result["allreduce"], count)
    link = costmodel.INTERCONNECTS[args.interconnect]
    gpus = [2**k for k in range(1, 10)]
    here = costmodel.predict(compute_time, result["gradient_bytes"], gpus, bandwidth, latency)
    there = costmodel.predict(compute_time, result["gradient_bytes"], gpus, link.bandwidth, link.latency)
    rows = [
        {"gpus": a["gpus"], f"this {backend} link": a["efficiency"], args.interconnect: b["efficiency"]}
        for a, b in zip(here, there)
    ]
    tables.append(
        gk.Table(
            rows,
            title=f"predicted efficiency (compute {compute_time * 1e3:.1f} ms/step, "
            f"gradients {gk.format_bytes(result['gradient_bytes'])}; link here {bandwidth / 1e9:.2f} GB/s, "
            f"{latency * 1e6:.0f} µs)",
        )
    )
    print(tables[-1])
    print(f"\n{result['device']}, torch {torch.__version__}, {datetime.date.today()}")
    if args.json:
        save_tables(args.json, tables, device=result["device"], world_size=count)


if __name__ == "__main__":
    main()
