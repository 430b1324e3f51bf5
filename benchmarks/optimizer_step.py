"""How long does each optimizer's step take, and how much state does it keep?

For every optimizer name of gpukit.optim, on the kit's CNN and GPT: the median time of
`optimizer.step()` alone (the gradients of one real batch stay in place), measured with the
optimizers interleaved (A, B, C, A, B, C, …) so that drifts in clock or load hit all alike, as
a ratio to SGD's; and the state bytes measured after the step against the prediction of
gk.memory.optimizer_state_bytes.

On a CPU Muon's step stands out: torch.optim.Muon runs Newton–Schulz in bfloat16, and a bf16
matrix product of (512, 128) took ~17× as long as fp32 on the 2-core Xeon here (measured under load).

    python benchmarks/optimizer_step.py                  # CPU
    python benchmarks/optimizer_step.py --device cuda    # a GPU (foreach kernels, larger models)
"""

from __future__ import annotations

import argparse
import datetime
import platform

import torch

import gpukit as gk
from gpukit.optim import OPTIMIZERS, make_optimizer
from gpukit.report import save_tables


def models(device: torch.device) -> dict:
    big = device.type == "cuda"
    tokens = torch.randint(0, 256, (16, 65), device=device)
    return {
        f"fast_cnn({64 if big else 16})": (
            lambda: gk.models.fast_cnn(64 if big else 16),
            (torch.randn(32, 3, 32, 32, device=device), torch.randint(0, 10, (32,), device=device)),
        ),
        f"gpt(width {384 if big else 128})": (
            lambda: gk.models.gpt(width=384 if big else 128, depth=6 if big else 4, heads=4, max_seq_len=64),
            (tokens[:, :-1], tokens[:, 1:]),
        ),
    }


def measure(build, batch, device: torch.device, repeats: int) -> list[dict]:
    steps, rows = {}, []
    for name in OPTIMIZERS:
        torch.manual_seed(0)
        model = build().to(device)
        optimizer = make_optimizer(name, model, 1e-3, 5e-4)
        inputs, target = batch
        outputs = model(inputs)
        torch.nn.functional.cross_entropy(outputs.reshape(-1, outputs.shape[-1]), target.reshape(-1)).backward()
        optimizer.step()  # creates the state
        measured = sum(v.nbytes for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor))
        predicted = gk.memory.optimizer_state_bytes(model, name)
        parameter_bytes = sum(p.nbytes for p in model.parameters())
        rows.append(
            {
                "optimizer": name,
                "state ÷ parameters": measured / parameter_bytes,
                "prediction exact": measured == predicted,
            }
        )
        steps[name] = optimizer.step
    timings = gk.bench.compare(steps, device=device, warmup=3, repeats=repeats)
    for row in rows:
        timing = timings[row["optimizer"]]
        row["step ms (median)"] = timing.median * 1e3
        row["× sgd"] = timing.median / timings["sgd"].median
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--json", metavar="PATH", help="also write the figures to PATH as JSON (gk.report.save_tables)")
    args = parser.parse_args()
    device = torch.device(args.device)
    print(
        f"{datetime.date.today()} torch {torch.__version__} on {device} ({platform.processor() or platform.machine()})"
    )
    tables = []
    for label, (build, batch) in models(device).items():
        tables.append(gk.Table(measure(build, batch, device, args.repeats), title=label))
        print(tables[-1])
    if args.json:
        save_tables(args.json, tables, device=str(device), repeats=args.repeats)


if __name__ == "__main__":
    main()
