"""How much does gpukit.fit add over a hand-written PyTorch loop?

Both loops train the same model (same initial weights) on the same batches from the same
loader with the same optimizer and learning-rate schedule; the script first checks that they
end with identical parameters, so they did the same work. Then it runs them interleaved
(hand, fit, hand, fit, …) so that drift in clocks or background load hits both alike, and
reports the ratio of median step times and the overhead in µs per step. Three models:

- mlp: a tiny MLP (64 → 128 → 10) on random batches of 32 held in a list, SGD with Nesterov momentum: a step
  of a few hundred µs, so the ratio is fit's own per-step overhead (Lightning Fabric added 57 µs, 1.25-1.39×);
- cnn: the fast CNN on shapes (DeviceLoader), SGD with Nesterov momentum;
- gpt: the small GPT on byte tokens of the standard library (TextLoader), AdamW (1-D parameters not decayed).

For both: images or tokens per second and MFU against this device's peak (CUDA: the datasheet;
CPU: a measured fp32 matmul), and each mixed precision's speed-up over fp32.

    python benchmarks/fit_overhead.py                       # fp32 and bf16-mixed, the CNN and the GPT
    python benchmarks/fit_overhead.py --models mlp --precisions fp32 --threads 1 --steps 200 --rounds 15
    python benchmarks/fit_overhead.py --first-step 10       # the first step in a fresh process, then exit
    python benchmarks/fit_overhead.py --device cuda --width 64 --batch-size 512 --gpt-width 384 --gpt-depth 6

Each round times a whole call of `steps` optimizer steps, fit's setup included: the figure is
what a user pays, not only the inner loop.

--first-step N: the wait from calling fit to the end of its first step, in a fresh Python that has imported torch
(and built one optimizer, which imports torch._dynamo: seconds that the hand-written loop pays alike), against the
same for the hand-written loop; N fresh processes of each, interleaved. The aim: fit within 50 ms of the hand loop.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
import torch.nn.attention

import gpukit as gk
from gpukit.bench import synchronize
from gpukit.report import save_tables


@contextlib.contextmanager
def deterministic_kernels():
    before = torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.benchmark
    torch.use_deterministic_algorithms(True, warn_only=True)  # warn, not fail, where an op has no such kernel
    torch.backends.cudnn.benchmark = False
    try:
        # Attention's fused CUDA backwards add in a varying order; the math kernel does not.
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
            yield
    finally:
        torch.use_deterministic_algorithms(before[0])
        torch.backends.cudnn.benchmark = before[1]


def hand_written_optimizer(model, kind: str, lr: float, steps: int):
    """(optimizer, one-cycle schedule) as gk.fit builds them: SGD with Nesterov momentum, or AdamW for the GPT."""
    if kind in ("cnn", "mlp"):
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    else:
        # AdamW as nanoGPT and gk.fit's "adamw" build it: matrices decayed, 1-D parameters (LayerNorm scales and
        # shifts, biases) not. Decaying every parameter here made the GPT's loops end 1.9e-2 apart on a CPU.
        decayed = [p for p in model.parameters() if p.dim() >= 2]
        plain = [p for p in model.parameters() if p.dim() < 2]
        groups = [{"params": decayed, "weight_decay": 5e-4}, {"params": plain, "weight_decay": 0.0}]
        optimizer = torch.optim.AdamW(groups, lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=lr,
        total_steps=steps + 1,
        pct_start=0.2 * steps / (steps + 1),
        cycle_momentum=False,
        div_factor=25.0,
        final_div_factor=1e4,
    )
    return optimizer, schedule


def hand_written_steps(
    model,
    loader,
    optimizer,
    schedule,
    steps: int,
    dtype: torch.dtype | None,
    device: torch.device,
    backward=torch.Tensor.backward,
) -> None:
    """`steps` optimizer steps: autocast forward, `backward(loss)`, optimizer step, schedule step. `model` and `optimizer` may be another library's wrappers (benchmarks/peers.py)."""
    # fp32 means fp32, as in gk.fit: PyTorch lets cuDNN run fp32 convolutions in TF32 unless told otherwise
    # (on an H100 that made the two loops end 5e-2 apart).
    torch.backends.cudnn.allow_tf32 = dtype is not None
    torch.set_float32_matmul_precision("highest")
    model.train()
    if hasattr(loader, "set_epoch"):  # the device loaders; the MLP's list of batches has none
        loader.set_epoch(0)
    for step, (inputs, target) in enumerate(loader):
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            logits = model(inputs)  # (B, classes) or (B, T, 256)
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))
        backward(loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        schedule.step()
        if step + 1 == steps:
            break


def hand_written_loop(
    model, loader, steps: int, lr: float, dtype: torch.dtype | None, device: torch.device, kind: str
) -> None:
    """The loop a PyTorch user writes: autocast forward, backward, optimizer step, one-cycle schedule."""
    optimizer, schedule = hand_written_optimizer(model, kind, lr, steps)
    hand_written_steps(model, loader, optimizer, schedule, steps, dtype, device)


def gpukit_loop(
    model, loader, steps: int, lr: float, precision: str, device: torch.device, progress: bool, kind: str
) -> None:
    gk.fit(
        model,
        loader,
        epochs=1,
        max_steps=steps,
        lr=lr,
        precision=precision,
        device=device,
        progress=progress,
        optimizer="adamw" if kind == "gpt" else "nesterov",
    )


def tiny_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def mlp_batches(batch_size: int, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`count` batches of 64 random features and a class of 10, seeded: a list, as a user may hand fit."""
    generator = torch.Generator().manual_seed(0)
    return [
        (torch.randn(batch_size, 64, generator=generator), torch.randint(0, 10, (batch_size,), generator=generator))
        for _ in range(count)
    ]


def setup(kind: str, args, device: torch.device):
    """(loader, initial model, learning rate) for one of the two models."""
    torch.manual_seed(0)
    if kind == "mlp":
        batches = [
            (inputs.to(device), target.to(device)) for inputs, target in mlp_batches(args.batch_size, args.steps)
        ]
        return batches, tiny_mlp().to(device), args.lr
    if kind == "cnn":
        train, _ = gk.data.shapes(args.batch_size * args.steps, 0, seed=0)
        loader = gk.data.DeviceLoader(train, args.batch_size, augment=True, device=device, seed=0)
        return loader, gk.models.fast_cnn(args.width).to(device), args.lr
    train, _ = gk.data.text(seq_len=args.seq_len, max_bytes=args.gpt_batch_size * args.steps * (args.seq_len + 1) * 2)
    loader = gk.data.TextLoader(train, args.gpt_batch_size, device=device, seed=0)
    model = gk.models.gpt(max_seq_len=args.seq_len, width=args.gpt_width, depth=args.gpt_depth, heads=args.gpt_heads)
    return loader, model.to(device), 3e-3


def measure(kind: str, precision: str, args, device: torch.device) -> dict:
    dtype = {"fp32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}[precision]
    loader, initial, lr = setup(kind, args, device)

    # Same work: both loops must end with the same parameters. Deterministic kernels for this check only:
    # cuDNN's weight-gradient kernels add in a varying order on a GPU, and 40 steps grow that into 1e-2.
    a, b = copy.deepcopy(initial), copy.deepcopy(initial)
    with deterministic_kernels():
        hand_written_loop(a, loader, args.steps, lr, dtype, device, kind)
        gpukit_loop(b, loader, args.steps, lr, precision, device, False, kind)
    worst = max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))
    tolerance = 1e-4 if dtype is None else 5e-2
    if worst > tolerance:
        raise SystemExit(f"the loops disagree ({kind}, {precision}): max parameter difference {worst:.2e}")

    runners = {
        "hand-written": lambda m: hand_written_loop(m, loader, args.steps, lr, dtype, device, kind),
        "gpukit.fit": lambda m: gpukit_loop(m, loader, args.steps, lr, precision, device, False, kind),
        "gpukit.fit + progress bar": lambda m: gpukit_loop(m, loader, args.steps, lr, precision, device, True, kind),
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
    samples = args.gpt_batch_size if kind == "gpt" else args.batch_size
    rows = []
    for name, times in step_times.items():
        median = statistics.median(times)
        q1, _, q3 = statistics.quantiles(times, n=4)
        rows.append(
            {
                "model": kind,
                "precision": precision,
                "loop": name,
                "median_step_ms": median * 1e3,
                "iqr_ms": (q3 - q1) * 1e3,
                "ratio": median / hand,
                "overhead_us_per_step": (median - hand) * 1e6,
                "samples_per_s": samples / median,
            }
        )
    batch = next(iter(loader))
    flops = gk.bench.flops_per_step(initial, batch)  # counted once, on the real model and batch
    items = batch[1].numel()  # samples for the MLP, images for the CNN, tokens for the GPT
    fit_step = statistics.median(step_times["gpukit.fit"])
    throughput = {"items_per_s": items / fit_step, "flops_per_item": flops / items, "tflops": flops / fit_step / 1e12}
    return {"rows": rows, "max_parameter_difference": worst, "throughput": throughput, "fit_step": fit_step}


def device_peak(device: torch.device, precision: str) -> tuple[float | None, str]:
    """Peak TFLOP/s for MFU: the datasheet on CUDA, in the step's precision; on a CPU, a measured fp32
    2048² matmul for every precision: a CPU without bf16 units emulates bf16 matmuls at about 1 GFLOP/s
    (measured on an AMD EPYC), slower than the training step itself, so that is no ceiling."""
    if device.type == "cuda":
        name = "fp32" if precision == "fp32" else precision.removesuffix("-mixed")
        return gk.bench.peak_tflops(torch.cuda.get_device_name(device), name), "datasheet"
    return gk.bench.matmul_tflops(device, "fp32", 2048), "measured fp32 matmul, n=2048"


def first_step_in_this_process(loop: str) -> float:
    """Seconds from calling the loop to the end of its first step, in a fresh process with torch warm (one
    optimizer built first: it imports torch._dynamo, seconds that either loop would pay)."""
    torch.set_num_threads(1)
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    model, batches, device = tiny_mlp(), mlp_batches(32, 1), torch.device("cpu")
    started = time.perf_counter()
    if loop == "hand-written":
        hand_written_loop(model, batches, 1, 0.1, None, device, "mlp")
    else:
        gk.fit(model, batches, max_steps=1, lr=0.1, device=device, progress=False)
    return time.perf_counter() - started


def first_step(processes: int) -> gk.Table:
    """`processes` fresh Pythons per loop, interleaved (hand, fit, hand, …); medians and the spread."""
    seconds: dict[str, list[float]] = {"hand-written": [], "gpukit.fit": []}
    for _ in range(processes):
        for loop, times in seconds.items():
            command = [sys.executable, __file__, "--child-first-step", loop]
            times.append(json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout))
    hand = statistics.median(seconds["hand-written"])
    rows = [
        {
            "loop": loop,
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "over_hand_written_ms": (statistics.median(times) - hand) * 1e3,
        }
        for loop, times in seconds.items()
    ]
    title = f"from the call to the end of the first step, fresh process, torch warm ({processes} each, interleaved)"
    return gk.Table(rows, title=title)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="cnn,gpt")
    parser.add_argument("--width", type=int, default=16, help="fast CNN width (16: 0.14 M parameters)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step for the CNN")
    parser.add_argument(
        "--gpt-width", type=int, default=128, help="with 4 blocks: 0.8 M parameters, the size RESULTS.md reports"
    )
    parser.add_argument("--gpt-depth", type=int, default=4)
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--gpt-batch-size", type=int, default=32, help="windows per step for the GPT")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per timed call")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds")
    parser.add_argument("--lr", type=float, default=0.1, help="the CNN's peak learning rate")
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    parser.add_argument("--threads", type=int, help="intra-op CPU threads (default: torch's)")
    parser.add_argument("--first-step", type=int, metavar="N", help="time the first step in N fresh processes each")
    parser.add_argument("--child-first-step", help=argparse.SUPPRESS)  # one fresh process's measurement
    args = parser.parse_args()
    if args.child_first_step:
        print(json.dumps(first_step_in_this_process(args.child_first_step)))
        return
    if args.first_step:
        print(f"load average {gk.env.cpu_load()}\n{first_step(args.first_step)}")
        return
    if args.threads:
        torch.set_num_threads(args.threads)
    device = gk.resolve_device(args.device)
    rows, mfu_rows, fit_steps = [], [], {}
    for kind in args.models.split(","):
        for precision in args.precisions.split(","):
            result = measure(kind, precision, args, device)
            print(
                f"{kind}, {precision}: loops agree (max parameter difference {result['max_parameter_difference']:.1e})"
            )
            rows += result["rows"]
            fit_steps[kind, precision] = result["fit_step"]
            peak, source = device_peak(device, precision)
            counted = result["throughput"]
            mfu_rows.append(
                {
                    "model": kind,
                    "precision": precision,
                    "unit": {"cnn": "image", "gpt": "token"}.get(kind, "sample"),
                    "per_s": counted["items_per_s"],
                    "achieved_tflops": counted["tflops"],
                    "peak_tflops": peak,
                    "peak": source,
                    "mfu": counted["tflops"] / peak if peak else None,
                }
            )
    # The mixed-precision speed-up: fit's median step in fp32 over the same in each other precision.
    speedups = [
        {"model": kind, "precision": precision, "speed_up_over_fp32": fit_steps[kind, "fp32"] / step}
        for (kind, precision), step in fit_steps.items()
        if precision != "fp32" and (kind, "fp32") in fit_steps
    ]
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(
        f"\nCNN width {args.width}, batch {args.batch_size}; GPT width {args.gpt_width}, depth {args.gpt_depth}, "
        f"batch {args.gpt_batch_size} × {args.seq_len} tokens; {args.steps} steps per call, {args.rounds} rounds; "
        f"{device} ({name}), {torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    tables = [
        gk.Table(rows, title="gpukit.fit against a hand-written loop"),
        gk.Table(mfu_rows, title="throughput and MFU of gpukit.fit (FLOPs counted on the model, peak as stated)"),
    ]
    if speedups:
        tables.append(gk.Table(speedups, title="mixed precision: fit's fp32 step time ÷ its step time"))
    print(*tables, sep="\n\n")
    if args.json:
        save_tables(args.json, tables, device=name, steps=args.steps, rounds=args.rounds)


if __name__ == "__main__":
    main()
