"""How light is gpukit.fit beside its peers: a hand-written loop, Lightning Fabric and Hugging Face Accelerate?

Every contender trains the same model (the same initial weights) on the same batches with the same optimizer,
one-cycle schedule and number of steps, in fp32; the loop body is fit_overhead.py's hand-written one, with Fabric's
or Accelerate's wrapped model and optimizer and their `backward(loss)` where a peer is used. First each contender
trains once under deterministic kernels and must end with parameters bit-equal (torch.equal) to the hand-written
loop's: a contender that did other work stops the benchmark. Then the contenders run in interleaved rounds (A, B, C,
D, A, B, C, D, …; round 0 warms up and is dropped), each round a whole call of `steps` steps, setup included, and
each contender's step time is divided by the hand-written loop's of the same round: the table gives the median of
those per-round ratios and their min–max. A peer that is not installed is skipped with a printed line
(`pip install "gpukit[bench]"` installs both). Three models, as in fit_overhead.py:

- mlp: a tiny MLP (64 → 128 → 10) on random batches of 32 held in a list, SGD with Nesterov momentum: a step of a
  few hundred µs, so the ratio is each library's own per-step cost;
- cnn: the fast CNN (gk.models.fast_cnn) on shapes (DeviceLoader), SGD with Nesterov momentum;
- gpt: the small GPT (gk.models.gpt) on byte tokens of the standard library (TextLoader), AdamW.

The same table has each contender's first step: from building its objects (Fabric, Accelerator, optimizer, fit's
setup) to the end of its first step on the MLP, the first call in a fresh Python with torch (and the contender's
library) already imported; one subprocess per call, interleaved, N of each. And each library's import time beyond
torch, again in fresh subprocesses.

    python benchmarks/peers.py                              # one CPU thread, all three models
    python benchmarks/peers.py --models mlp --mlp-steps 200 --rounds 15 --first-step 10
    python benchmarks/peers.py --device cuda --width 64 --batch-size 512 --gpt-width 384 --gpt-depth 6
"""

from __future__ import annotations

import argparse
import copy
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time

import torch
from fit_overhead import (
    deterministic_kernels,
    gpukit_loop,
    hand_written_loop,
    hand_written_optimizer,
    hand_written_steps,
    mlp_batches,
    setup,
    tiny_mlp,
)

import gpukit as gk
from gpukit.bench import synchronize
from gpukit.report import format_value, save_tables

HAND = "hand-written"
# The contenders that need a library beyond torch, and the module each imports.
MODULES = {"gpukit.fit": "gpukit", "Lightning Fabric": "lightning_fabric", "Accelerate": "accelerate"}


def hand_loop(model, loader, steps: int, lr: float, device: torch.device, kind: str) -> None:
    hand_written_loop(model, loader, steps, lr, None, device, kind)


def fit_loop(model, loader, steps: int, lr: float, device: torch.device, kind: str) -> None:
    gpukit_loop(model, loader, steps, lr, "fp32", device, False, kind)


def fabric_loop(lightning_fabric, model, loader, steps: int, lr: float, device: torch.device, kind: str) -> None:
    """Fabric's documented loop: setup(model, optimizer), then fabric.backward(loss)."""
    devices = [device.index or 0] if device.type == "cuda" else 1
    fabric = lightning_fabric.Fabric(accelerator=device.type, devices=devices, precision="32-true")
    optimizer, schedule = hand_written_optimizer(model, kind, lr, steps)
    model, optimizer = fabric.setup(model, optimizer)
    hand_written_steps(model, loader, optimizer, schedule, steps, None, device, fabric.backward)


def accelerate_loop(accelerate, model, loader, steps: int, lr: float, device: torch.device, kind: str) -> None:
    """Accelerate's documented loop: prepare(model, optimizer, schedule), then accelerator.backward(loss). The
    batches are on the device already, as fit and the hand-written loop get them, so the loader is not prepared."""
    accelerator = accelerate.Accelerator(cpu=device.type == "cpu", mixed_precision="no")
    optimizer, schedule = hand_written_optimizer(model, kind, lr, steps)
    model, optimizer, schedule = accelerator.prepare(model, optimizer, schedule)
    hand_written_steps(model, loader, optimizer, schedule, steps, None, device, accelerator.backward)


def contenders() -> tuple[dict, list[str]]:
    """({name: loop(model, loader, steps, lr, device, kind)}, a "skipped: …" line for each peer not installed)."""
    loops, skipped = {HAND: hand_loop, "gpukit.fit": fit_loop}, []
    for name, loop in [("Lightning Fabric", fabric_loop), ("Accelerate", accelerate_loop)]:
        try:
            library = importlib.import_module(MODULES[name])
        except ImportError as error:  # an optional peer: pip install "gpukit[bench]"
            skipped.append(f"skipped: {name} because it cannot be imported ({error}); pip install 'gpukit[bench]'")
            continue
        loops[name] = lambda *args, library=library, loop=loop: loop(library, *args)
    return loops, skipped


def model_args(kind: str, args) -> argparse.Namespace:
    """`args` with the steps and batch size of `kind`: the MLP has its own (batch 32, many short steps)."""
    if kind == "mlp":
        return argparse.Namespace(**{**vars(args), "steps": args.mlp_steps, "batch_size": 32})
    return args


def same_work(loops: dict, initial, loader, steps: int, lr: float, device: torch.device, kind: str) -> dict:
    """{contender: its largest parameter difference from the hand-written loop's, or 0.0 where every parameter is
    torch.equal}, each trained once under deterministic kernels from a copy of `initial`."""
    trained = {}
    with deterministic_kernels():
        for name, loop in loops.items():
            trained[name] = copy.deepcopy(initial)
            loop(trained[name], loader, steps, lr, device, kind)
    hand = list(trained[HAND].parameters())
    differences = {}
    for name, model in trained.items():
        if all(torch.equal(p, q) for p, q in zip(hand, model.parameters())):
            differences[name] = 0.0
        else:  # a nonzero figure, even where the largest difference underflows to 0 (a NaN, a changed shape)
            differences[name] = max((p - q).abs().max().item() for p, q in zip(hand, model.parameters())) or 1.0
    return differences


def timed_rounds(loops: dict, initial, loader, steps: int, lr: float, device: torch.device, kind: str, rounds: int):
    """{contender: seconds per step in each of `rounds` interleaved rounds}; round 0 warms up and is dropped."""
    seconds: dict[str, list[float]] = {name: [] for name in loops}
    for round_index in range(rounds + 1):
        for name, loop in loops.items():
            model = copy.deepcopy(initial)
            synchronize(device)
            started = time.perf_counter()
            loop(model, loader, steps, lr, device, kind)
            synchronize(device)
            if round_index > 0:
                seconds[name].append((time.perf_counter() - started) / steps)
    return seconds


def measure(kind: str, args, device: torch.device, loops: dict) -> list[dict]:
    """One row per contender: median step, and the median and min–max of its per-round ratio to the hand loop."""
    sized = model_args(kind, args)
    loader, initial, lr = setup(kind, sized, device)
    differences = same_work(loops, initial, loader, sized.steps, lr, device, kind)
    different = {name: difference for name, difference in differences.items() if difference}
    if different:
        listed = ", ".join(f"{name} (max parameter difference {value:.1e})" for name, value in different.items())
        raise SystemExit(f"{kind}: not bit-equal to the hand-written loop, so not the same work: {listed}")
    seconds = timed_rounds(loops, initial, loader, sized.steps, lr, device, kind, args.rounds)
    hand = statistics.median(seconds[HAND])
    rows = []
    for name, times in seconds.items():
        ratios = [time_ / hand_time for time_, hand_time in zip(times, seconds[HAND])]  # same round, same load
        rows.append(
            {
                "model": kind,
                "loop": name,
                "steps": sized.steps,
                "median_step_ms": statistics.median(times) * 1e3,
                "ratio": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "over_hand_us_per_step": (statistics.median(times) - hand) * 1e6,
                "bit_equal": differences[name] == 0.0,
            }
        )
    return rows


def first_step_in_this_process(name: str, device: torch.device) -> float:
    """Seconds from building `name`'s objects to the end of its first MLP step; torch, gpukit and the peers are
    imported and one optimizer was built (it imports torch._dynamo, seconds that every loop would pay alike)."""
    loop = contenders()[0][name]
    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    model = tiny_mlp().to(device)
    batches = [(inputs.to(device), target.to(device)) for inputs, target in mlp_batches(32, 1)]
    synchronize(device)
    started = time.perf_counter()
    loop(model, batches, 1, 0.1, device, "mlp")
    synchronize(device)
    return time.perf_counter() - started


def run_child(command: list[str]):
    """What the fresh Python running `command` prints, read as JSON."""
    return json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)


def import_seconds(module: str) -> float:
    """Seconds to import `module` in a fresh Python that has imported torch."""
    code = f"import json, time, torch\nstarted = time.perf_counter()\nimport {module}\n"
    code += "print(json.dumps(time.perf_counter() - started))"
    return run_child([sys.executable, "-c", code])


def fresh_processes(names, processes: int, args) -> tuple[dict, dict]:
    """({contender: first-step seconds}, {contender: import seconds beyond torch}): `processes` fresh Pythons per
    contender and measurement, interleaved (A, B, C, A, B, C, …)."""
    first: dict[str, list[float]] = {name: [] for name in names}
    imports: dict[str, list[float]] = {name: [] for name in names if name in MODULES}
    for _ in range(processes):
        for name in names:
            command = [sys.executable, __file__, "--child-first-step", name, "--device", args.device]
            command += ["--threads", str(args.threads)] if args.threads else []
            first[name].append(run_child(command))
        for name in imports:
            imports[name].append(import_seconds(MODULES[name]))
    return first, imports


def spread(values: list[float]) -> str:
    """'median (min–max)', each as gk.Table writes a number."""
    return f"{format_value(statistics.median(values))} ({format_value(min(values))}–{format_value(max(values))})"


def summary(rows: list[dict], first: dict, imports: dict) -> gk.Table:
    """One row per contender: its step-time ratio on each model, first step and import time."""
    table = []
    for name in dict.fromkeys(row["loop"] for row in rows) or first:
        line = {"loop": name}
        for row in rows:
            if row["loop"] == name:
                line[f"{row['model']} ÷ hand"] = f"{row['ratio']:.3f} ({row['ratio_min']:.3f}–{row['ratio_max']:.3f})"
        if first:
            line["first step ms"] = spread([s * 1e3 for s in first[name]])
            hand = statistics.median(first[HAND])
            line["first step over hand ms"] = (statistics.median(first[name]) - hand) * 1e3
            line["import beyond torch ms"] = spread([s * 1e3 for s in imports[name]]) if name in imports else "0"
        table.append(line)
    title = "ratios: median (min–max) of per-round step time ÷ the hand-written loop's; first step: median (min–max)"
    return gk.Table(table, title=title)


def parse_arguments(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--models", default="mlp,cnn,gpt")
    parser.add_argument("--width", type=int, default=16, help="fast CNN width (16: 0.14 M parameters)")
    parser.add_argument("--batch-size", type=int, default=64, help="images per step for the CNN")
    parser.add_argument("--gpt-width", type=int, default=128, help="with 4 blocks: 0.8 M parameters")
    parser.add_argument("--gpt-depth", type=int, default=4)
    parser.add_argument("--gpt-heads", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--gpt-batch-size", type=int, default=32, help="windows per step for the GPT")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps per timed call, CNN and GPT")
    parser.add_argument("--mlp-steps", type=int, default=200, help="optimizer steps per timed call, MLP")
    parser.add_argument("--rounds", type=int, default=9, help="interleaved timed rounds")
    parser.add_argument("--lr", type=float, default=0.1, help="the MLP's and CNN's peak learning rate")
    parser.add_argument("--threads", type=int, help="intra-op CPU threads (default: 1 on a CPU, torch's on CUDA)")
    parser.add_argument("--first-step", type=int, default=5, metavar="N", help="fresh processes per contender")
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    parser.add_argument("--child-first-step", help=argparse.SUPPRESS)  # one fresh process's measurement
    args = parser.parse_args(argv)
    if min(args.steps, args.mlp_steps) < 6:  # fit's warm-up (a fifth of the steps) is then under ~1 step, where its
        # schedule starts at the peak by hand and the hand-written loop's OneCycleLR does not: not the same work
        parser.error("--steps and --mlp-steps must be at least 6 (a warm-up of more than one step)")
    if args.threads is None and args.device == "cpu":
        args.threads = 1  # one thread: the loops' own costs, not how two busy cores share out a matmul
    return args


def main(argv=None) -> None:
    args = parse_arguments(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = gk.resolve_device(args.device)
    if args.child_first_step:
        print(json.dumps(first_step_in_this_process(args.child_first_step, device)))
        return
    loops, skipped = contenders()
    print(*skipped, sep="\n")
    load_before = gk.env.cpu_load()
    rows = []
    for kind in args.models.split(","):
        rows += measure(kind, args, device, loops)
        print(f"{kind}: every contender bit-equal to the hand-written loop ({', '.join(loops)})")
    first, imports = fresh_processes(loops, args.first_step, args) if args.first_step else ({}, {})
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    print(
        f"\nMLP batch 32, {args.mlp_steps} steps per call; CNN width {args.width}, batch {args.batch_size}; GPT width "
        f"{args.gpt_width}, depth {args.gpt_depth}, batch {args.gpt_batch_size} × {args.seq_len} tokens; "
        f"{args.steps} steps per call; {args.rounds} rounds; first step: {args.first_step} fresh processes each; "
        f"{device} ({name}), {torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"load average {load_before} before, {gk.env.cpu_load()} after"
    )
    tables = [summary(rows, first, imports), gk.Table(rows, title="step times, fp32")]
    print(*tables, sep="\n\n")
    if args.json:
        save_tables(args.json, tables, device=name, rounds=args.rounds, peers_skipped=skipped)


if __name__ == "__main__":
    main()
