"""The input pipeline measured: storage formats × cold/warm, and decode/augment paths × device.

1. Formats: the same images written as JPEG files (one per image), WebDataset tar shards of JPEGs
   and one uint8 array (memory-mapped), read per sample and in batches, cold (evicted from the page
   cache, checked with mincore) and warm. Rounds are interleaved (every format and mode in each round)
   and the median of the rounds is reported, with the bytes on disk.
2. Decoding: PIL vs torchvision's batched decode_jpeg on the CPU and on CUDA, and transforms.v2 per
   image in DataLoader workers vs on whole batches (CUDA rows say "skipped: no GPU" without one).

    python benchmarks/input_pipeline.py                       # 8,192 images of 32×32, decode at 128 px
    python benchmarks/input_pipeline.py --images 50000 --decode-size 256 --workers 8
    python benchmarks/input_pipeline.py --device cuda --json input.json   # fail unless the CUDA rows run

Published figures to hold these against: batched decode_jpeg(device="cuda") on an A100 ~7,800
images/s vs ~390/s on one CPU thread (pytorch/vision#8496); FFCV 31,000 images/s from RAM on 96
cores, the standard DataLoader ~4,000 and WebDataset ~7,600 (FFCV's benchmarks).
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

import gpukit as gk
from gpukit.data.pagecache import can_evict
from gpukit.report import save_tables


def formats_table(images: int, rounds: int, batch_size: int, folder: Path) -> gk.Table:
    dataset, _ = gk.data.shapes(images, 8, seed=0)
    started = time.perf_counter()
    stores = {
        "JPEG files": gk.data.FileImages(gk.data.write_files(dataset, folder / "files")),
        "tar shards (JPEG)": gk.data.ShardLoader(gk.data.write_shards(dataset, folder / "shards"), batch_size),
        "uint8 array (memmap)": gk.data.ArrayImages(gk.data.write_array(dataset, folder / "array")),
    }
    print(f"wrote {images} images three ways in {time.perf_counter() - started:.1f} s")
    results: dict[tuple, list[dict]] = {}
    for repeat in range(rounds):
        for name, store in stores.items():
            for cold in (True, False):
                for batch in (None, batch_size):
                    row = gk.data.read_throughput(store, cold=cold, batch_size=batch, seed=repeat)
                    results.setdefault((name, cold, batch), []).append(row)
    rows = []
    for (name, cold, batch), runs in results.items():
        rows.append(
            {
                "format": name,
                "cache": "cold" if cold else "warm",
                "read": "per sample" if batch is None else f"batches of {batch}",
                "samples_per_second": statistics.median(run["samples_per_second"] for run in runs),
                "megabytes_per_second": statistics.median(run["megabytes_per_second"] for run in runs),
                "on_disk": gk.format_bytes(runs[0]["bytes_on_disk"]),
                "max_resident_before": max(run["resident_before"] for run in runs) if cold and can_evict() else None,
            }
        )
    return gk.Table(rows, title=f"reading {images} images of 32×32, median of {rounds} interleaved rounds")


def decode_table(count: int, size: int, batch_size: int, workers: int, gpu: bool | None) -> gk.Table:
    dataset, _ = gk.data.shapes(count, 8, seed=1)
    jpegs = gk.data.decoding.photo_jpegs(dataset.images, size)  # grain: they cost what photographs cost to decode
    print(f"{count} JPEGs of {size}×{size}, {sum(map(len, jpegs)) / count / 1e3:.1f} kB each")
    return gk.data.decode_table(
        jpegs, size=size * 3 // 4, batch_size=batch_size, num_workers=workers, repeats=3, gpu=gpu
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=8192, help="images written in each format")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds per format and mode")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--decode-images", type=int, default=512)
    parser.add_argument("--decode-size", type=int, default=128, help="pixels per side of the decoded JPEGs")
    parser.add_argument("--workers", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--folder", type=Path, default=None, help="where to write (default: a temporary folder)")
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=None,
        help="the decoding rows: cuda needs a GPU, cpu skips the CUDA rows (default: cuda where present)",
    )
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    gpu = None if args.device is None else args.device == "cuda"
    if gpu and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU and there is none here; use --device cpu.")

    print(
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores, torch {torch.__version__}, "
        f"CUDA GPU: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}; "
        f"load average {os.getloadavg()[0]:.1f} at the start"
    )
    folder = args.folder or Path(tempfile.mkdtemp(prefix="gpukit-input-"))
    try:
        tables = [formats_table(args.images, args.rounds, args.batch_size, folder)]
        print(tables[-1], end="\n\n")
        tables.append(decode_table(args.decode_images, args.decode_size, args.batch_size, args.workers, gpu))
        print(tables[-1])
    finally:
        if args.folder is None:
            shutil.rmtree(folder, ignore_errors=True)
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if args.json:
        save_tables(args.json, tables, cpu_cores=os.cpu_count(), images=args.images, rounds=args.rounds)


if __name__ == "__main__":
    main()
