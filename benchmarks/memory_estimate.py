"""How close is gk.memory.estimate (fake tensors, nothing run) to the memory a real step uses?

For each model, precision and batch size: the predicted peak of one training step against the
measured tensors (gk.memory.breakdown: on a GPU the CUDA allocator's highest count after any
operator, i.e. torch.cuda.max_memory_allocated less the workspace; on a CPU the tensor storages
tracked per operator, the whole measured peak), and whether the predicted saved-activation bytes
equal the measured ones. On a GPU the table also shows the workspace, memory held only inside an
operator (cuDNN's convolution workspaces, large in strict fp32), which a prediction from tensors
cannot include, and the whole measured peak. Memory is deterministic for a given step, so each
case runs once.

    python benchmarks/memory_estimate.py                        # CPU: small batches, 64×64 for torchvision
    python benchmarks/memory_estimate.py --device cuda          # batches 32-256, 224×224 for torchvision

Target on a GPU: predicted peak within 10% of the measured tensors at batch sizes 32-256 in fp32
and bf16-mixed; the workspace is reported beside it, not predicted. Without a GPU the script still
runs and says what it measured.
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
        return row | {"measured tensors (MiB)": None, "error %": None, "note": "out of memory"}
    # The tensors the allocator held: its highest count after any operator (the whole peak on a CPU).
    tensors = measured.total - (measured.workspace or 0)
    difference = measured.activations - predicted.activations
    # torch's fake (meta) BatchNorm returns its saved mean and inverse std in the 16-bit input dtype;
    # the real kernels keep them in fp32: 2 bytes more per channel for each of the two.
    batchnorm = 4 * sum(m.num_features for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d))
    note = "" if difference == 0 else f"activations differ by {difference:+,} B"
    if difference and precision != "fp32" and difference == batchnorm:
        note += " = BatchNorm statistics in fp32, not bf16 as torch's fake kernel says"
    return row | {
        "measured tensors (MiB)": tensors / 2**20,
        "error %": 100 * (predicted.total - tensors) / tensors,
        "workspace (MiB)": None if measured.workspace is None else measured.workspace / 2**20,
        "measured peak (MiB)": measured.total / 2**20,
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
    print(
        f"# gk.memory.estimate vs a measured step (tensors, and workspace on a GPU): {name}, torch {torch.__version__}, {datetime.date.today()}"
    )
    print(f"# optimizer {args.optimizer}; torchvision models at {image_size}×{image_size}\n")
    columns = ["batch", "precision", "predicted (MiB)", "measured tensors (MiB)", "error %", "workspace (MiB)",
               "measured peak (MiB)", "activations equal", "note"]  # fmt: skip
    if not on_gpu:  # no workspace is measured on a CPU, and the tensors are the whole peak
        columns = [column for column in columns if column not in ("workspace (MiB)", "measured peak (MiB)")]
    rows, tables = [], []
    for model_name in args.models:
        build, size = MODELS[model_name]
        cases = [
            run_case(build, size or image_size, batch, precision, args.optimizer, device)
            for precision in args.precisions
            for batch in batch_sizes
        ]
        rows += cases
        tables.append(gk.Table(cases, columns, title=model_name))
        print(tables[-1], "\n")
    summary = _summary(rows)
    if summary:
        print(
            f"prediction vs measured tensors: largest |error| {summary['largest_error_percent']:.2f}%; "
            f"{summary['cases_within_10_percent']} of {summary['cases']} cases within 10% (the target on a GPU)"
        )
    if "largest_workspace_mib" in summary:
        print(
            f"workspace inside operators (measured, not predicted): up to {summary['largest_workspace_mib']:,.0f} MiB, "
            f"{summary['largest_workspace_percent']:.0f}% of that step's measured peak"
        )
    if args.json:
        save_tables(args.json, tables, device=name, optimizer=args.optimizer, **summary)


def _summary(rows: list[dict]) -> dict:
    """The figures the target is judged on: errors against the measured tensors, and the largest workspace."""
    measured = [row for row in rows if row["error %"] is not None]
    if not measured:
        return {}
    errors = [abs(row["error %"]) for row in measured]
    summary = {
        "largest_error_percent": max(errors),
        "cases_within_10_percent": sum(error <= 10 for error in errors),
        "cases": len(errors),
    }
    with_workspace = [row for row in measured if row.get("workspace (MiB)") is not None]
    if with_workspace:
        largest = max(with_workspace, key=lambda row: row["workspace (MiB)"])
        summary["largest_workspace_mib"] = largest["workspace (MiB)"]
        summary["largest_workspace_percent"] = 100 * largest["workspace (MiB)"] / largest["measured peak (MiB)"]
    return summary


if __name__ == "__main__":
    main()
