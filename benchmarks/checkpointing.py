"""What does activation checkpointing save, and what does it cost, on deep CNNs?

For each model: the bytes saved for backward and the peak of one training step (gk.memory.breakdown)
without and with gk.memory.apply_activation_checkpointing, for two strategies (every block its own
region; about sqrt(n) regions of consecutive blocks), and the step times, timed interleaved
(plain, every block, sqrt, plain, …) so that drift hits all alike; the ratios are of medians.

    python benchmarks/checkpointing.py                          # CPU: batch 16, small inputs
    python benchmarks/checkpointing.py --device cuda --batch-size 128

Targets: saved-activation bytes at least 3× smaller, step time at most 1.35× (the cost in the
literature is about one extra forward pass, 20-30%).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import platform

import torch
import torchvision

import gpukit as gk
from gpukit.memory.activation_checkpointing import apply_activation_checkpointing
from gpukit.report import save_tables

STRATEGIES = {"every block": {}, "sqrt(n) segments": {"segments": "sqrt"}}
MODELS = {
    "resnet18 (kit, 32×32)": (gk.models.resnet18, 32),
    "torchvision resnet50": (lambda: torchvision.models.resnet50(num_classes=10), None),
}


def step_function(model, images, labels):
    """fit's training step (gk.step.TrainStep) on one batch, SGD with momentum, fp32."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = gk.step.TrainStep(model, optimizer, gk.get_precision("fp32", images.device))
    return lambda: step((images, labels))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cpu or cuda (default: the best available)")
    parser.add_argument("--batch-size", type=int, default=None)
    parser.add_argument("--image-size", type=int, default=None, help="torchvision models' input size")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    device = gk.resolve_device(args.device)
    on_gpu = device.type == "cuda"
    batch_size = args.batch_size or (128 if on_gpu else 16)
    image_size = args.image_size or (224 if on_gpu else 64)
    repeats = args.repeats or (20 if on_gpu else 7)
    name = (
        torch.cuda.get_device_name(device)
        if on_gpu
        else f"{platform.processor() or 'CPU'} ({torch.get_num_threads()} threads)"
    )
    print(f"# activation checkpointing: {name}, torch {torch.__version__}, {datetime.date.today()}")
    print(f"# batch {batch_size}, torchvision models at {image_size}×{image_size}, {repeats} interleaved repeats\n")
    rows = []
    for model_name in args.models:
        build, size = MODELS[model_name]
        torch.manual_seed(0)
        plain = build()
        images = torch.randn(batch_size, 3, size or image_size, size or image_size)
        labels = torch.zeros(batch_size, dtype=torch.long)
        models, plans = {"plain": plain}, {}
        for strategy, options in STRATEGIES.items():
            models[strategy] = copy.deepcopy(plain)
            plans[strategy] = apply_activation_checkpointing(models[strategy], **options)
        parts = {name: gk.memory.breakdown(model, images, labels, device=device) for name, model in models.items()}
        images, labels = images.to(device), labels.to(device)
        steps = {name: step_function(model.to(device), images, labels) for name, model in models.items()}
        timings = gk.bench.compare(steps, device=device, warmup=2, repeats=repeats)  # interleaved
        time_ratios = gk.bench.ratios(timings, baseline="plain")
        for strategy in STRATEGIES:
            saved_ratio = parts["plain"].activations / parts[strategy].activations
            rows.append(
                {
                    "model": model_name,
                    "regions": f"{strategy} ({len(plans[strategy].regions)})",
                    "saved, plain (MiB)": parts["plain"].activations / 2**20,
                    "saved, checkpointed (MiB)": parts[strategy].activations / 2**20,
                    "saved ÷": saved_ratio,
                    "peak, plain (MiB)": parts["plain"].total / 2**20,
                    "peak, checkpointed (MiB)": parts[strategy].total / 2**20,
                    "step plain (ms)": 1e3 * timings["plain"].median,
                    "step checkpointed (ms)": 1e3 * timings[strategy].median,
                    "time ×": time_ratios[strategy],
                    "≥3× less saved": saved_ratio >= 3,
                    "≤1.35× time": time_ratios[strategy] <= 1.35,
                }
            )
    table = gk.Table(rows, title="activation checkpointing (median step times, plain and both strategies interleaved)")
    print(table)
    if args.json:
        save_tables(args.json, [table], device=name, batch_size=batch_size, image_size=image_size, repeats=repeats)


if __name__ == "__main__":
    main()
