"""Which GPU for your model: what fits, the largest batch, step time, and the time and cost of a run.

Memory comes from gk.memory (fake tensors: nothing runs), step time from a roofline: a step takes at
least as long as its slowest limit, so the prediction is the longest of three times: its FLOPs at the
GPU's dense peak times a stated MFU, its memory traffic at the GPU's bandwidth, and its kernel launches
at a stated launch latency. On the machine present, `plan` times real steps at two batch sizes other
than yours: a line through them gives a fixed time per step and a time per example, whose FLOP rate
against the peak is the MFU. From that line it predicts a step at your batch, and times one there too
(plan.check), so you see how far to trust what it measured.

roofline.py holds the roofline and the plan's rows and table; calibration.py, the MFU measured here.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..bench import flops_per_step
from ..memory.measured_step import check_model, sample_batch
from ..memory.parts import MemoryBreakdown
from ..memory.prediction import precision_name, predict, resized
from ..precision import Precision
from ..report import format_bytes
from ..validation import check_int, check_number
from .calibration import MEASURE_HEADROOM, TYPICAL_MFU, _choose_mfu, calibration_sizes
from .gpus import GPU, GPUS, get_gpu
from .roofline import LAUNCH_SECONDS, Plan, PlanRow, _mark_pareto, _row, count_kernels, step_traffic

__all__ = [
    "LAUNCH_SECONDS",
    "MEASURE_HEADROOM",
    "PRICES",
    "PRICES_DATE",
    "PRICES_SOURCE",
    "TYPICAL_MFU",
    "Plan",
    "PlanRow",
    "calibration_sizes",
    "count_kernels",
    "plan",
    "step_traffic",
]

# Example on-demand prices in US$ per GPU-hour, for one GPU. Prices change often and differ by
# region, provider and commitment: these are examples to compare GPUs with, not quotes. Pass
# prices={...} to plan() with yours.
PRICES_DATE = "2025-06"
PRICES_SOURCE = (
    "public on-demand list prices as of 2025-06: AWS us-east-1 (T4 g4dn.xlarge, L4 g6.xlarge, A10G g5.xlarge, "
    "L40S g6e.xlarge), Lambda (A100, H100, H200, B200, per GPU), RunPod (RTX 4090, RTX 5090); approximate"
)
PRICES: dict[str, float] = {
    "T4": 0.53,
    "L4": 0.80,
    "A10G": 1.01,
    "L40S": 1.86,
    "A100 40GB": 1.29,
    "A100 80GB": 1.79,
    "H100 SXM": 2.99,
    "H100 PCIe": 2.49,
    "H200": 3.79,
    "B200": 4.99,
    "RTX 4090": 0.69,
    "RTX 5090": 0.89,
}


def _check_prices(prices: dict) -> dict[str, float]:
    checked = {}
    for name, price in prices.items():
        check_number(f"the price of {name}", price, note="of US$ per GPU-hour")
        checked[get_gpu(name).name] = float(price)
    return checked


def _largest_batches(
    peak: Callable[[int], int], usables: dict[int, int], size: int, activations: int
) -> dict[int, int]:
    """The largest batch under each usable budget (bytes), such that peak(b) ≤ usable < peak(b + 1).

    The peak is a line in the batch size once activations dominate: a line through the sample's
    prediction and one near the largest answer (guessed from the activations per example) gives
    every answer; it is checked at the smallest and the largest budget, and only where the check
    fails does each answer get corrected by further predictions.
    """
    per_example = max(activations / size, 1.0)
    far = max(size + 1, size + int((max(usables.values()) - peak(size)) / per_example))
    slope = max((peak(far) - peak(size)) / (far - size), 1.0)

    def from_line(usable: int) -> int:
        return max(0, size + math.floor((usable - peak(size)) / slope))

    def corrected(usable: int, answer: int) -> int:
        for _ in range(16):  # each move is by the error in examples: one or two suffice
            if answer >= 1 and peak(answer) > usable:
                answer = max(0, answer - max(1, int((peak(answer) - usable) / slope)))
            elif peak(answer + 1) <= usable:
                answer += max(1, int((usable - peak(answer + 1)) / slope))
            else:
                return answer
        return answer

    budgets = sorted(set(usables.values()))
    answers = {usable: from_line(usable) for usable in budgets}
    ends = {usable: corrected(usable, answers[usable]) for usable in (budgets[0], budgets[-1])}
    if any(ends[usable] != answers[usable] for usable in ends):  # the line is off: correct every answer
        answers = {usable: corrected(usable, answers[usable]) for usable in budgets}
    answers |= ends
    return {memory: answers[usable] for memory, usable in usables.items()}


def plan(
    model: nn.Module,
    batch,
    labels: torch.Tensor | None = None,
    *,
    steps: int = 10_000,
    gpus: Sequence[str | GPU] | None = None,
    optimizer: str = "adamw",
    precision: str | Precision = "bf16-mixed",
    margin: float = 0.1,
    mfu: float | str = "measured",
    prices: dict[str, float] | None = None,
    device: str | torch.device | None = None,
    loss_fn: str | Callable | None = None,
    repeats: int = 9,
) -> Plan:
    """For each GPU: does a training step of `model` on `batch` fit, the largest batch that fits, the
    predicted step time, and the time and cost of `steps` optimizer steps.

    batch: an example batch of any form fit accepts (its size is the plan's batch size).
    margin: the fraction of each GPU's memory kept free (allocator fragmentation, cuDNN workspaces,
        the CUDA context: the prediction does not include them).
    mfu: the fraction of a GPU's dense peak the step reaches. "measured" (default): measured for
        this model on the machine present (`device`, default the best here; on a CPU against the
        CPU's own measured matmul peak) and assumed for every GPU, unless those steps would not fit in the
        memory free here (predicted first, with fake tensors): then TYPICAL_MFU, said in one printed line;
        "typical": TYPICAL_MFU; or a number.
    prices: US$ per GPU-hour by GPU name, on top of the example PRICES (see PRICES_SOURCE).
    With mfu="measured", the prediction is also checked here (plan.check): steps timed at the two batch
    sizes `calibration_sizes` gives (not yours) predict a step at your batch (a line: a fixed time per
    step plus a time per example), against a step timed at your batch, all interleaved. On a CPU they
    run on one thread and are timed by its CPU time (time.thread_time), which other processes on a busy
    machine do not inflate. `repeats`: timed steps at each size (their median counts), after 2 untimed.
    Your model is not changed (the measured steps train a copy).
    """
    check_model(model)
    sample = sample_batch(model, batch, labels)
    precision = precision_name(precision)
    check_int("steps", steps, note="(optimizer steps)")
    if not 0 <= margin < 1:
        raise ValueError(f"margin must be a fraction in [0, 1), got {margin!r}; 0.1 keeps 10% of memory free.")
    if mfu not in ("measured", "typical") and (isinstance(mfu, (str, bool)) or not 0 < mfu <= 1):
        raise ValueError(f"mfu must be 'measured', 'typical' or a fraction in (0, 1], got {mfu!r}.")
    chosen = [get_gpu(gpu) for gpu in (gpus if gpus is not None else GPUS.values())]
    if not chosen:
        raise ValueError("gpus is empty; leave it out to plan for every GPU in gk.hardware.GPUS.")
    price_table = PRICES | _check_prices(prices or {})
    size = sample.size
    target = torch.device("cuda")

    @functools.cache
    def predicted(batch_size: int) -> MemoryBreakdown:
        return predict(
            model,
            sample,
            batch_size,
            optimizer=optimizer,
            precision=precision,
            target=target,
            loss_fn=loss_fn,
            set_to_none=True,
        )

    memory = predicted(size)
    flops = flops_per_step(model, resized(sample, size, torch.device("meta")), loss_fn=loss_fn)
    traffic = step_traffic(memory)
    kernels = count_kernels(model, sample, loss_fn)
    usables = {gpu.memory_bytes: int(gpu.memory_bytes * (1 - margin)) for gpu in chosen}
    largest = _largest_batches(lambda b: predicted(b).total, usables, size, memory.activations)

    measuring = (optimizer, precision, device, loss_fn, repeats)
    mfu_value, mfu_source, check = _choose_mfu(mfu, model, sample, flops, *measuring)
    work = {"flops": flops, "traffic": traffic, "kernels": kernels, "mfu": mfu_value, "steps": steps}
    rows = [
        _row(gpu, usables[gpu.memory_bytes], memory.total, largest[gpu.memory_bytes], price_table.get(gpu.name),
             precision, **work)
        for gpu in chosen
    ]  # fmt: skip
    if not any(row.fits for row in rows):
        raise ValueError(_fits_nowhere(rows, memory, size, precision, optimizer))
    _mark_pareto(rows)
    source = PRICES_SOURCE + ("; some given by you" if prices else "")
    return Plan(
        rows,
        size,
        steps,
        precision,
        optimizer,
        margin,
        flops,
        traffic,
        kernels,
        memory,
        mfu_value,
        mfu_source,
        source,
        check,
    )


def _fits_nowhere(rows: list[PlanRow], memory: MemoryBreakdown, size: int, precision: str, optimizer: str) -> str:
    biggest = max(rows, key=lambda row: row.usable)
    fixes = [
        f"a smaller batch ({biggest.largest_batch} fits the {biggest.gpu})" if biggest.largest_batch else None,
        "precision='bf16-mixed'" if precision in ("fp32", "tf32") else None,
        "optimizer='nesterov' (less optimizer state)" if optimizer not in ("sgd", "nesterov", "momentum") else None,
        "activation checkpointing (gk.memory.apply_activation_checkpointing)",
        "gradient accumulation (fit(accumulate=k))",
        "sharding over several GPUs (FSDP, lesson 04)",
    ]
    return (
        f"a step at batch {size} needs {format_bytes(memory.total)}, but the largest GPU in the table, the "
        f"{biggest.gpu}, has {format_bytes(biggest.usable)} usable: {format_bytes(memory.total - biggest.usable)} "
        f"short. Fixes from lesson 03: {', '.join(fix for fix in fixes if fix)}."
    )
