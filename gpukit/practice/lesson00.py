"""Lesson 00's exercises (environment, CPU and GPU): how a matmul's time grows with its size, a timer built by hand
against gk.bench's, and the FLOPs of a training step counted by hand."""

from __future__ import annotations

import time

import torch
from torch import nn

from .. import bench
from ..env import detect, seed_everything
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer, compare
from .exercise import progress as _progress

LESSON = "00_environment_and_cpu_vs_gpu"
BEFORE = "## What to take away"


def _matmul_side(device: str) -> int:
    # Large enough that arithmetic, not the fixed cost of a call, sets the time: 384 on a CPU of the tiny profile
    # (~20 ms at 2n on one core), half the profile's matmul on a larger one (512: several threads need more work
    # each to run at full speed), 4096 on a GPU (8192: ~1 TFLOP, tens of ms in strict fp32).
    return 4096 if device == "cuda" else max(384, detect().profile.matmul_size // 2)


def _clock(device: str):
    # One CPU thread: its own CPU time, which other programs on a busy machine do not inflate (lesson 00, section 4).
    return time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter


# --- 1 · predict: how a matmul's time grows with n ---------------------------------------------------------------


def _measure_matmul_growth() -> list[float]:
    device = detect().device
    n = _matmul_side(device)
    small = [torch.randn(n, n, device=device) for _ in range(2)]
    large = [torch.randn(2 * n, 2 * n, device=device) for _ in range(2)]
    timings = bench.compare(
        {"n": lambda: small[0] @ small[1], "2n": lambda: large[0] @ large[1]},
        device=device,
        warmup=1,
        repeats=7,
        clock=_clock(device),
    )
    return [two_n / one_n for one_n, two_n in zip(timings["n"].times, timings["2n"].times)]  # one ratio per round


matmul_growth = Prediction(
    key="00.matmul_growth",
    kind="predict",
    title="how a matmul's time grows with its side",
    prompt="""### Exercise 1 · Predict: twice the side, how much longer?

An n×n matmul large enough to keep your device busy (n = 384 or 512 on a CPU, 4096 on a GPU) takes some time t. **Predict how
many times longer a (2n)×(2n) matmul takes** (a ratio, e.g. `3.0`). Section 2 gave the FLOPs of a matmul. The check
times both here, in turn, seven times, and judges your ratio against the median round within their spread.""",
    starter="""growth_prediction = ...  # time of a (2n)×(2n) matmul ÷ time of an n×n one
""",
    answer="growth_prediction",
    solution_code="""# 2·n³ FLOPs: each of the n² outputs is a sum of n products. Doubling n doubles all three: 2³ = 8 times the work,
# and a matmul that keeps the device busy runs at about the same FLOP/s at both sizes.
growth_prediction = 2**3
""",
    hints=(
        "how many FLOPs does an n×n matmul take (section 2)? What happens to that count when n doubles?",
        "2·n³: the n² outputs each sum n products",
        "(2n)³ / n³",
    ),
    wrong_answers=(
        WrongAnswer("growth_prediction = 4", "the work grows as n³"),
        WrongAnswer("growth_prediction = 16", "four factors of n"),
    ),
    measure=_measure_matmul_growth,
    what="the measured ratio",
    unit="x",
    floor=0.3,  # the two sizes run at somewhat different FLOP/s (caches, tiling, threads)
    mistakes=(
        Mistake(
            0.5,
            "the matrices hold 4x the numbers, but the work grows as n³: each of the n² outputs sums n "
            "products, and n doubled too",
        ),
        Mistake(0.25, "twice the side is not twice the time: count the FLOPs, 2·n³"),
        Mistake(2.0, "that is four factors of n: a matmul is 2·n³ FLOPs, three"),
    ),
)


# --- 2 · build it: a timer that agrees with gk.bench -------------------------------------------------------------

TIMER_REPEATS = 10


def _judge_timer(my_timer) -> Verdict:
    env = detect()
    if env.device == "cuda":
        n = _matmul_side(env.device)
        a, b = (torch.randn(n, n, device=env.device) for _ in range(2))

        def work():  # queued on the GPU: a timer that does not wait for it reads far too little
            return a @ b
    else:

        def work():  # 5 ms that other programs on a busy CPU cannot stretch, as they stretch arithmetic
            time.sleep(0.005)

    yours, kit = [], []
    for _ in range(6):  # rounds, interleaved, so that load on the machine hits both timers alike
        answer = my_timer(work, TIMER_REPEATS)
        if not isinstance(answer, (int, float)):
            return Verdict(False, f"my_timer must return a number of seconds, got {answer!r}")
        yours.append(float(answer))
        kit.append(bench.timeit(work, device=env.device, warmup=1, repeats=TIMER_REPEATS).median)
    # The best round of each, the least disturbed by other programs on the machine.
    return compare(
        min(yours),
        [min(kit)],
        floor=0.3,
        what="gk.bench.timeit's best round",
        unit=" s",
        mistakes=_TIMER_MISTAKES,
        advice="time one call, between two readings of the clock, after a warm-up, and return the median in seconds",
    )


_TIMER_MISTAKES = (
    Mistake(1000.0, "did you return milliseconds? Return seconds"),
    Mistake(
        float(TIMER_REPEATS),
        f"about {TIMER_REPEATS}x: did you return the total of all {TIMER_REPEATS} calls? "
        "Return the median of one call's times",
    ),
    Mistake(2.0, "about 2x: did you call fn twice between the two readings of the clock?"),
    Mistake(
        0.01,
        "far too fast: GPU work is queued and returns at once; call torch.cuda.synchronize() before "
        "reading the clock, each time",
    ),
)

time_it = Exercise(
    key="00.time_it",
    kind="build",
    title="a timer that agrees with gk.bench.timeit",
    prompt=f"""### Exercise 2 · Build it: a timer

Write `my_timer(fn, repeats)`: it returns the **median time in seconds of one call of `fn()`**, over `repeats` timed
calls, after a warm-up call, right on a CPU and on a GPU (section 2, "Timing GPU work correctly"). The check times a
few milliseconds of work with your timer and with `gk.bench.timeit`, in turn, six times each ({TIMER_REPEATS} calls a
time), and compares the best of each: on a GPU a matmul; on a CPU a 5 ms wait, which other programs on the machine
cannot stretch as they stretch arithmetic (lesson 00, section 4).""",
    starter="""def my_timer(fn, repeats):
    ...  # the median seconds of one call of fn(), over `repeats` timed calls after a warm-up call
""",
    answer="my_timer",
    solution_code="""import statistics
import time


def my_timer(fn, repeats):
    def wait_for_the_device():  # GPU work is queued: the clock must wait until it has run
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    fn()  # warm-up: one-time costs (allocations, a library choosing its kernels) are not the steady state
    times = []
    for _ in range(repeats):
        wait_for_the_device()
        started = time.perf_counter()
        fn()
        wait_for_the_device()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
""",
    hints=(
        "read time.perf_counter() before and after each call, keep each difference, return their median",
        "warm up with one untimed call; on a GPU, torch.cuda.synchronize() before each reading of the clock",
        "started = time.perf_counter(); fn(); synchronize; times.append(time.perf_counter() - started)",
    ),
    wrong_answers=(
        WrongAnswer(
            """import time


def my_timer(fn, repeats):
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - started
""",
            f"the total of all {TIMER_REPEATS} calls",
        ),
        WrongAnswer(
            """import statistics
import time


def my_timer(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
""",
            "did you call fn twice",
        ),
        WrongAnswer(
            """import statistics
import time


def my_timer(fn, repeats):
    fn()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        times.append(time.perf_counter() - started)
    return statistics.median(times)
""",
            "call torch.cuda.synchronize()",
            needs_gpu=True,
        ),
    ),
    judge=_judge_timer,
)


# --- 3 · predict: the FLOPs of a training step -------------------------------------------------------------------


def _measure_step_flops() -> list[float]:
    # torch's FLOP counter, over the operators one real forward and backward pass runs (gk.bench.flops_per_step).
    seed_everything(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.ReLU(), nn.Linear(128, 10))
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(32, 3, 32, 32, generator=generator), torch.randint(0, 10, (32,), generator=generator))
    return [float(bench.flops_per_step(model, batch))]


step_flops = Prediction(
    key="00.step_flops",
    kind="predict",
    title="the FLOPs of one training step, by hand",
    prompt="""### Exercise 3 · Predict: the FLOPs of a training step

A classifier `nn.Flatten()` → `nn.Linear(3072, 128)` → `nn.ReLU()` → `nn.Linear(128, 10)` takes one training step
(forward, loss, backward) on a batch of 32 images of 3 × 32 × 32. **Predict its FLOPs**, counting the matrix
products (section 3 counts a CNN's the same way). The check counts them with torch's FLOP counter on a real step.""",
    starter="""flops_prediction = ...  # FLOPs of one forward and backward pass on 32 images
""",
    answer="flops_prediction",
    solution_code="""batch = 32
first, second = 3072 * 128, 128 * 10  # multiply-adds per image of each Linear layer
forward = 2 * batch * (first + second)  # 2 FLOPs (a multiply and an add) per multiply-add
# Backward: for each layer the gradient of its weights (as costly as its forward) and of its input (as costly
# again), except the first layer's input: the images need no gradient.
flops_prediction = forward + 2 * batch * (first + 2 * second)
""",
    hints=(
        "a Linear layer of in × out weights costs 2 · in · out FLOPs per example forward (a multiply and an add)",
        "backward computes two products per layer, each as costly as the forward: the gradients of the weights and of "
        "the layer's input; which layer's input needs no gradient?",
        "3 × the forward, less the first layer's input gradient (2 · 32 · 3072 · 128)",
    ),
    wrong_answers=(
        WrongAnswer("flops_prediction = 2 * 32 * (3072 * 128 + 128 * 10)", "the forward pass only"),
        WrongAnswer("flops_prediction = 3 * 2 * 32 * (3072 * 128 + 128 * 10)", "the images need no gradient"),
        WrongAnswer("flops_prediction = 4 * 32 * (2 * 3072 * 128 + 3 * 128 * 10)", "a multiply-add is 2 FLOPs, not 4"),
    ),
    measure=_measure_step_flops,
    what="the counted FLOPs",
    unit=" FLOP",
    floor=0.05,
    mistakes=(
        Mistake(
            0.5,
            "half the counted: did you count the forward pass only (backward costs twice the forward), or "
            "one FLOP per multiply-add (it is 2)?",
        ),
        Mistake(
            1.5,
            "did you count a gradient for the images? The first layer computes its weights' gradient only: "
            "the images need no gradient",
        ),
        Mistake(2.0, "twice the counted: a multiply-add is 2 FLOPs, not 4"),
        Mistake(1 / 3, "a third of the counted: the backward pass costs about twice the forward"),
    ),
)


# --- 4 · predict (a GPU): how much faster the GPU multiplies ----------------------------------------------------

GPU_SIDE, CPU_SIDE = 4096, 512


def _measure_gpu_over_cpu() -> list[float]:
    # Strict fp32 matmuls on each device, timed in turn, three rounds: the GPU's rate over the CPU's, per round.
    ratios = []
    for _ in range(3):
        gpu = bench.matmul_tflops("cuda", "fp32", GPU_SIDE, repeats=5)
        cpu = bench.matmul_tflops("cpu", "fp32", CPU_SIDE, repeats=3)
        ratios.append(gpu / cpu)
    return ratios


gpu_over_cpu = Prediction(
    key="00.gpu_over_cpu",
    kind="predict",
    title="how many times faster the GPU multiplies in fp32",
    prompt=f"""### Exercise 4 · Predict: the GPU against the CPU

**Predict how many times the GPU's fp32 matmul rate (TFLOP/s, a {GPU_SIDE}×{GPU_SIDE} matmul) is the CPU's (a
{CPU_SIDE}×{CPU_SIDE} one, on the threads this lesson uses)**, from what section 2 measured, or measure it again with
`gk.bench.matmul_tflops`. The check times both here, in turn, three times.""",
    starter="""gpu_prediction = ...  # the GPU's fp32 TFLOP/s ÷ the CPU's
""",
    answer="gpu_prediction",
    solution_code=f"""# Each rate as section 2 measured it: 2·n³ FLOPs over the time of an n×n matmul, strict fp32 on both.
gpu_tflops = gk.bench.matmul_tflops("cuda", "fp32", {GPU_SIDE}, repeats=5)
cpu_tflops = gk.bench.matmul_tflops("cpu", "fp32", {CPU_SIDE}, repeats=3)
gpu_prediction = gpu_tflops / cpu_tflops
""",
    hints=(
        "section 2's table has a TFLOP/s for each device in fp32",
        "the ratio of the two rates; gk.bench.matmul_tflops(device, 'fp32', n) measures one",
        f"gk.bench.matmul_tflops('cuda', 'fp32', {GPU_SIDE}) / gk.bench.matmul_tflops('cpu', 'fp32', {CPU_SIDE})",
    ),
    wrong_answers=(
        WrongAnswer(
            f"""gpu_prediction = 2 * gk.bench.matmul_tflops("cuda", "fp32", {GPU_SIDE}) / gk.bench.matmul_tflops(
    "cpu", "fp32", {CPU_SIDE})
""",
            "twice the measured",
        ),
        WrongAnswer(
            f"""gpu_prediction = gk.bench.matmul_tflops("cpu", "fp32", {CPU_SIDE}) / gk.bench.matmul_tflops(
    "cuda", "fp32", {GPU_SIDE})
""",
            "too low",
        ),
    ),
    measure=_measure_gpu_over_cpu,
    what="the measured ratio",
    unit="x",
    floor=0.3,  # the CPU's rate moves with what else runs on it
    mistakes=(
        Mistake(2.0, "twice the measured: did you compare with TF32 or bf16? The check is strict fp32 on both"),
        Mistake(0.5, "half the measured: strict fp32 on both, each on a matmul large enough for it"),
    ),
    needs_gpu="it times a matmul on a CUDA GPU",
)


EXERCISES = (matmul_growth, time_it, step_flops, gpu_over_cpu)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
