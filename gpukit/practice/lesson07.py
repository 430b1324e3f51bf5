"""Lesson 07's exercises (choosing a GPU): the largest batch that fits a budget, and the plan's step-time line (a
fixed time per step plus a time per example) written by hand and held against a step it never saw."""

from __future__ import annotations

import time

import torch

from .. import bench, memory, models
from ..env import detect
from ..step import TrainStep
from .exercise import Exercise, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "07_choosing_and_watching_a_gpu"
BEFORE = "## Summary"

BUDGET = 24 * 2**20  # bytes: the memory the exercise's step may use


def _images(count: int) -> torch.Tensor:
    return torch.randn(count, 3, 32, 32, generator=torch.Generator().manual_seed(0))


# --- 1 · predict: the largest batch that fits ---------------------------------------------------------------------


def _peak(batch: int) -> int:
    """Bytes at the peak of a real AdamW step of fast_cnn(8) in fp32 on `batch` images, measured (gk.memory.breakdown)."""
    return memory.breakdown(models.fast_cnn(8), _images(batch), optimizer="adamw", device=detect().device).total


def _judge_largest(largest_prediction) -> Verdict:
    if isinstance(largest_prediction, bool) or not isinstance(largest_prediction, (int, float)):
        return Verdict(False, f"give the batch as a number, not {largest_prediction!r}")
    batch = int(largest_prediction)
    if batch < 1:
        return Verdict(False, f"a batch has at least one image, not {largest_prediction!r}")
    mib = 2**20
    peak = _peak(batch)
    if peak > BUDGET:  # measured at the answer itself: it must fit
        say = "twice the largest: " if peak > 1.8 * BUDGET else ""
        return Verdict(
            False,
            f"a step of {batch} images peaked at {peak / mib:.3g} MiB here, {peak / BUDGET:.2f}x the "
            f"{BUDGET / mib:.0f} MiB budget: {say}too large; the part of the peak that grows with "
            "the batch is the activations, counted once per image",
        )
    larger = max(batch + 1, round(1.1 * batch))
    larger_peak = _peak(larger)
    if larger_peak <= BUDGET:  # and a batch 10% larger must not
        say = "half the measured largest or less: " if _peak(2 * batch) <= BUDGET else ""
        return Verdict(
            False,
            f"a step of {batch} images fits ({peak / mib:.3g} MiB), but so does one of {larger} "
            f"({larger_peak / mib:.3g} MiB of {BUDGET / mib:.0f}): {say}not the largest; did you "
            "count each image twice, or the fixed part (weights, gradients, AdamW's state) as many "
            "times?",
        )
    return Verdict(
        True,
        f"a step of {batch} images peaked at {peak / mib:.3g} MiB, within {BUDGET / mib:.0f} MiB, and "
        f"one of {larger} at {larger_peak / mib:.3g} MiB, beyond it: measured here",
    )


largest_batch = Exercise(
    key="07.largest_batch",
    kind="predict",
    title="the largest batch that fits a memory budget",
    prompt="""### Exercise 1 · Predict: the largest batch that fits

`gk.models.fast_cnn(8)`, trained with AdamW in fp32 on 32×32 images, on this machine's device, may use a budget of
**24 MiB** (`24 * 2**20` bytes) at its peak. **Predict the largest batch that fits.** Work it out from what a step
needs: measure or predict a step at two batch sizes (`gk.memory.breakdown` or `gk.memory.estimate`, lesson 03) and
draw the line. The check measures real steps here: one at your batch must fit, one 10% larger must not.""",
    starter="""largest_prediction = ...  # the largest batch of fast_cnn(8)'s AdamW step within 24 MiB
""",
    answer="largest_prediction",
    solution_code="""# The peak is a fixed part (weights, gradients, AdamW's state) plus a part per image (activations): two steps give
# the line, and the line meets the budget at the largest batch.
images = torch.randn(32, 3, 32, 32)
peaks = {batch: gk.memory.breakdown(gk.models.fast_cnn(8), images[:batch], optimizer="adamw", device=env.device).total
         for batch in (8, 32)}
per_image = (peaks[32] - peaks[8]) / (32 - 8)
fixed = peaks[8] - 8 * per_image
largest_prediction = int((24 * 2**20 - fixed) // per_image)
""",
    hints=(
        "the peak grows with the batch: a fixed part, and a part per image; find both",
        "gk.memory.breakdown(model, images[:b], optimizer='adamw').total at two batch sizes gives two points of a line",
        "per_image = (peak(32) - peak(8)) / 24; fixed = peak(8) - 8 · per_image; (budget - fixed) // per_image",
    ),
    wrong_answers=(
        WrongAnswer(
            """images = torch.randn(32, 3, 32, 32)
peak = gk.memory.breakdown(gk.models.fast_cnn(8), images, optimizer="adamw", device=env.device).total
largest_prediction = 2 * int(24 * 2**20 / (peak / 32))
""",
            "twice the largest",
        ),
        WrongAnswer(
            """images = torch.randn(32, 3, 32, 32)
peak = gk.memory.breakdown(gk.models.fast_cnn(8), images, optimizer="adamw", device=env.device).total
largest_prediction = int(24 * 2**20 / (peak / 32)) / 2
""",
            "half the measured largest",
        ),
    ),
    judge=_judge_largest,
)


# --- 2 · build it: the step-time line ------------------------------------------------------------------------------

TIMED, UNSEEN = (4, 12, 24), 32


def _step(batch: int, device: str):
    model = models.fast_cnn(8).to(device)
    images, labels = _images(batch).to(device), torch.zeros(batch, dtype=torch.long, device=device)
    train_step = TrainStep(model, torch.optim.SGD(model.parameters(), lr=0.01), "fp32", device=device)
    return lambda: train_step((images, labels))


def _least_squares(timed: dict[int, float], batch: int) -> float:
    xs, ys = list(timed), list(timed.values())
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)
    return mean_y + slope * (batch - mean_x)


def _judge_line(predict_step_time) -> Verdict:
    device = detect().device
    # One thread on a CPU: its own CPU time, which other programs on a busy machine do not inflate (lesson 07).
    clock = time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
    timings = bench.compare(
        {b: _step(b, device) for b in (*TIMED, UNSEEN)}, device=device, warmup=1, repeats=5, clock=clock
    )
    timed = {b: timings[b].median for b in TIMED}
    yours = float(predict_step_time(dict(timed), UNSEEN))
    exact = _least_squares(timed, UNSEEN)
    if abs(yours - exact) > 1e-6 * abs(exact):
        ratio = yours / exact
        slip = (
            "your line goes through the origin: a step also costs a fixed time, whatever its batch"
            if abs(yours - timed[TIMED[-1]] * UNSEEN / TIMED[-1]) <= 1e-9 * abs(yours)
            else "fit both a fixed time per step and a time per example, by least squares over every timed point"
        )
        return Verdict(
            False,
            f"from the times measured here at batches {', '.join(map(str, TIMED))}, your function "
            f"predicts {yours * 1e3:.4g} ms at {UNSEEN}, {ratio:.3g}x the least-squares line's "
            f"{exact * 1e3:.4g} ms: {slip}",
        )
    measured = timings[UNSEEN].median
    return Verdict(
        True,
        f"your line through the steps timed here at {', '.join(map(str, TIMED))} predicts "
        f"{yours * 1e3:.4g} ms at batch {UNSEEN}; the step measured {measured * 1e3:.4g} ms "
        f"({yours / measured:.2f}x, shown, not checked: lesson 07 says how far such lines hold)",
    )


step_line = Exercise(
    key="07.step_line",
    kind="build",
    title="the plan's step-time line, by hand",
    prompt=f"""### Exercise 2 · Build it: the step-time line

`gk.hardware.plan` predicts a step's time from steps it timed at other batch sizes: a **fixed time per step** plus a
**time per example**, the line through them (section 2, "How far to trust it"). Write `predict_step_time(timed,
batch)`: `timed` maps batch sizes to measured seconds per step; return the seconds the least-squares line through
those points gives at `batch`. The check times `fast_cnn(8)`'s training step here at batches {
        ", ".join(map(str, TIMED))
    } and {UNSEEN}, interleaved, gives your function the first three, and compares its prediction with the line
and with the step at {UNSEEN}.""",
    starter="""def predict_step_time(timed, batch):
    ...  # seconds at `batch` on the least-squares line through timed = {batch size: seconds per step}
""",
    answer="predict_step_time",
    solution_code="""def predict_step_time(timed, batch):
    sizes, seconds = list(timed), list(timed.values())
    mean_size, mean_seconds = sum(sizes) / len(sizes), sum(seconds) / len(seconds)
    per_example = sum((b - mean_size) * (s - mean_seconds) for b, s in zip(sizes, seconds)) / sum(
        (b - mean_size) ** 2 for b in sizes)  # seconds each further example adds: the slope
    fixed = mean_seconds - per_example * mean_size  # seconds a step costs whatever its batch: the intercept
    return fixed + per_example * batch
""",
    hints=(
        "a step costs a fixed time plus a time per example: a straight line in the batch size, not through 0",
        "least squares: the slope is Σ(b - b̄)(s - s̄) / Σ(b - b̄)², and the line passes through (b̄, s̄)",
        "fixed = s̄ - slope · b̄; return fixed + slope · batch",
    ),
    wrong_answers=(
        WrongAnswer(
            """def predict_step_time(timed, batch):
    largest = max(timed)
    return timed[largest] * batch / largest
""",
            "your line goes through the origin",
        ),
        WrongAnswer(
            """def predict_step_time(timed, batch):
    (small, *_, large) = sorted(timed)
    per_example = (timed[large] - timed[small]) / (large - small)
    return 2 * (timed[small] + per_example * (batch - small))
""",
            "fit both a fixed time per step and a time per example",
        ),
    ),
    judge=_judge_line,
)


EXERCISES = (largest_batch, step_line)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
