"""How close is gk.memory.estimate (fake tensors, nothing run) to the memory a real step uses?

For each model, precision and batch size: the predicted peak of one training step against the
measured one (gk.memory.breakdown: torch.cuda.max_memory_allocated on a GPU; tensor storages
tracked per operator on a CPU), and whether the predicted saved-activation bytes equal the
measured ones. Memory is deterministic for a given step, so each case runs once.

    python benchmarks/memory_estimate.py                        # CPU: small batches, 64×64 for torchvision
    python benchmarks/memory_estimate.py --device cuda          # batches 32-256, 224×224 for torchvision

Target on a GPU: predicted peak within 10% of max_memory_allocated at batch sizes 32-256 in fp32
and bf16-mixed. Without a GPU the script still runs and says what it measured.
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch
import torchvision

import gpukit as gk
from gpukit import memory
from gpukit.report import save_tables

MODELS = {
    "fast_cnn(64)": (lambda: gk.models.fast_cnn(64), 32),
    "resnet18 (kit, 32×32)": (gk.models.resnet18, 32),
    "torchvision resnet18": (lambda: torchvision.models.resnet18(num_classes=10), None),
    "torchvision resnet50": (lambda: torchvision.models.resnet50(num_classes=10), None),
}


def run_case(build, size, batch_size, precision, optimizer, device) -> dict:
    torch.manual_seed(0)
    model = build()
    images = torch.randn(batch_size, 3, size, size)
    predicted = memory.estimate(model, images, optimizer=optimizer, precision=precision, device=device)
    try:
        measured = memory.breakdown(model, images, optimizer=optimizer, precision=precision, device=device)
    except torch.OutOfMemoryError:
        measured = None
    memory.free_memory(device)
    row = {"batch": batch_size, "precision": precision, "predicted (MiB)": predicted.total / 2**20}
    if measured is None:
        return row | {"measured (MiB)": None, "error %": None, "activations equal": None, "note": "out of memory"}
    difference = measured.activations - predicted.activations
    # torch's fake (meta) BatchNorm returns its saved mean and inverse std in the 16-bit input dtype;
    # the real kernels keep them in fp32: 2 bytes more per channel for each of the two.
    batchnorm = 4 * sum(m.num_features for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    note = "" if difference == 0 else f"activations differ by {difference:+,} B"
    if difference and precision != "fp32" and difference == batchnorm:
        note += " = BatchNorm statistics in fp32, not bf16 as torch's fake kernel says"
    return row | {
        "measured (MiB)": measured.total / 2**20,
        "error %": 100 * (predicted.total - measured.total) / measured.total,
        "activations equal": difference == 0,
        "note": note,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=None)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16-mixed"])
    parser.add_argument("--optimizer", default="nesterov")
    parser.add_argument("--image-size", type=int, default=None, help="torchvision models' input size")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    device = gk.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    batch_sizes = args.batch_sizes or ([32, 64, 128, 256] if on_gpu else [4, 8])
    image_size = args.image_size or (224 if on_gpu else 64)
    name = (
        torch.cuda.get_device_name(device)
        if on_gpu
        else f"{platform.processor() or 'CPU'} ({torch.get_num_threads()} threads)"
    )
    print(f"# gk.memory.estimate vs measured peak: {name}, torch {torch.__version__}, {datetime.date.today()}")
    print(f"# optimizer {args.optimizer}; torchvision models at {image_size}×{image_size}\n")
    errors, tables = [], []
    for model_name in args.models:
        build, size = MODELS[model_name]
        rows = [
            run_case(build, size or image_size, batch, precision, args.optimizer, device)
            for precision in args.precisions
            for batch in batch_sizes
        ]
        errors += [abs(row["error %"]) for row in rows if row["error %"] is not None]
        tables.append(gk.Table(rows, title=model_name))
        print(tables[-1], "\n")
    if errors:
        within = sum(error <= 10 for error in errors)
        print(f"largest |error| {max(errors):.2f}%; {within} of {len(errors)} cases within 10% (the target on a GPU)")
    if args.json:
        summary = {"largest_error_percent": max(errors), "cases_within_10_percent": within} if errors else {}
        save_tables(args.json, tables, device=name, optimizer=args.optimizer, **summary)


if __name__ == "__main__":
    main()
