"""How much does gpukit.fit add over a hand-written PyTorch loop?

Both loops train the same model (same initial weights) on the same batches from the same
DeviceLoader with the same optimizer and learning-rate schedule; the script first checks that
they end with identical parameters, so they did the same work. Then it runs them interleaved
(hand, fit, hand, fit, …) so that drift in clocks or background load hits both alike, and
reports the ratio of median step times and the overhead in µs per step.

    python benchmarks/fit_overhead.py                       # fp32 and bf16-mixed, fast CNN, batch 64
    python benchmarks/fit_overhead.py --device cuda --width 64 --batch-size 512

Each round times a whole call of `steps` optimizer steps, fit's setup included: the figure is
what a user pays, not only the inner loop.
"""

from __future__ import annotations

import argparse
import copy
import platform
import statistics
import time

import torch

import gpukit as gk
from gpukit.bench import synchronize


def hand_written_loop(model, loader, steps: int, lr: float, dtype: torch.dtype | None, device: torch.device) -> None:
    """The loop a PyTorch user writes: autocast forward, backward, SGD step, one-cycle schedule."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=lr, total_steps=steps + 1, pct_start=0.2 * steps / (steps + 1),
        cycle_momentum=False, div_factor=25.0, final_div_factor=1e4,
    )  # fmt: skip
    model.train()
    loader.set_epoch(0)
    for step, (images, labels) in enumerate(loader):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = torch.nn.functional.cross_entropy(model(images), labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step + 1 == steps:
            break


def gpukit_loop(model, loader, steps: int, lr: float, precision: str, device: torch.device, progress: bool) -> None:
    gk.fit(model, loader, epochs=1, max_steps=steps, lr=lr, precision=precision, device=device, progress=progress)


def measure(precision: str, args, device: torch.device) -> dict:
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    train, _ = gk.data.shapes(args.batch_size * args.steps, 0, seed=0)
    loader = gk.data.DeviceLoader(train, args.batch_size, augment=True, device=device, seed=0)
    torch.manual_seed(0)
    initial = gk.models.fast_cnn(args.width).to(device)

    # Same work: both loops must end with the same parameters.
    a, b = copy.deepcopy(initial), copy.deepcopy(initial)
    hand_written_loop(a, loader, args.steps, args.lr, dtype, device)
    gpukit_loop(b, loader, args.steps, args.lr, precision, device, progress=False)
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    tolerance = 1e-4 if dtype is None else 5e-2
    if worst > tolerance:
        raise SystemExit(f"the loops disagree ({precision}): max parameter difference {worst:.2e}")

    runners = {
        "hand-written": lambda m: hand_written_loop(m, loader, args.steps, args.lr, dtype, device),
        "gpukit.fit": lambda m: gpukit_loop(m, loader, args.steps, args.lr, precision, device, progress=False),
        "gpukit.fit + progress bar": lambda m: gpukit_loop(
            m, loader, args.steps, args.lr, precision, device, progress=True
        ),
    }
    step_times: dict[str, list[float]] = {name: [] for name in runners}
    for round_index in range(args.rounds + 1):  # round 0 warms up (allocator, caches) and is dropped
        for name, run in runners.items():
            model = copy.deepcopy(initial)
            synchronize(device)
            started = time.perf_counter()
            run(model)
            synchronize(device)
            if round_index > 0:
                step_times[name].append((time.perf_counter() - started) / args.steps)
    hand = statistics.median(step_times["hand-written"])
    rows = []
    for name, times in step_times.items():
        median = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4)
        rows.append({
            "precision": precision, "loop": name, "median_step_ms": median * 1e3, "iqr_ms": (q3 - q1) * 1e3,
            "ratio": median / hand, "overhead_us_per_step": (median - hand) * 1e6,
        })  # fmt: skip
    return {"rows": rows, "max_parameter_difference": worst}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--width", type=int, default=16, help="fast CNN width (16: 0.14 M parameters)")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per timed call")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    args = parser.parse_args()
    device = gk.resolve_device(args.device)
    rows = []
    for precision in args.precisions.split(","):
        result = measure(precision, args, device)
        print(f"{precision}: loops agree (max parameter difference {result['max_parameter_difference']:.1e})")
        rows += result["rows"]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(
        f"\nfast CNN width {args.width}, batch {args.batch_size}, {args.steps} steps per call, {args.rounds} rounds, "
        f"{device} ({name}), {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(gk.Table(rows))


if __name__ == "__main__":
    main()
