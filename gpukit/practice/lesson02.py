"""Lesson 02's exercises (the input pipeline): what two loader workers deliver from slow storage, and an input-bound
loop made compute-bound."""

from __future__ import annotations

import time

from torch.utils.data import DataLoader

from .. import data, models
from ..env import detect
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "02_input_pipeline"
BEFORE = "## What to take away"

WAIT = 0.02  # seconds the slow storage waits per image (gk.data.SlowDataset: a sleep, no CPU)
WORKER_BATCH = 4


# --- 1 · predict: two workers on slow storage --------------------------------------------------------------------


def _seconds_per_batch(workers: int, batches: int = 6) -> float:
    """Seconds per batch a DataLoader with `workers` processes delivers once they run: from the first batch (the
    workers started and each made one) to the last of `batches` more."""
    slow = data.SlowDataset(data.shapes(WORKER_BATCH * (batches + workers + 1), 0, seed=0)[0], WAIT)
    batches_of = iter(DataLoader(slow, batch_size=WORKER_BATCH, num_workers=workers))
    next(batches_of)
    started = time.perf_counter()
    for _ in range(batches):
        next(batches_of)
    return (time.perf_counter() - started) / batches


def _measure_two_workers() -> list[float]:
    return [_seconds_per_batch(2) for _ in range(3)]


two_workers = Prediction(
    key="02.two_workers",
    kind="predict",
    title="what two loader workers deliver from slow storage",
    prompt=f"""### Exercise 1 · Predict: two workers on slow storage

A dataset on slow storage waits {WAIT * 1e3:.0f} ms for each image, without using the CPU (`gk.data.SlowDataset`, as in
section 4). A `DataLoader` with `num_workers=2` reads it in batches of {WORKER_BATCH}: each worker builds whole
batches. **Predict the seconds per batch it delivers once its workers run** (the CPU work per image is far smaller
than the wait). The check times it here, three times.""",
    starter="""two_workers_prediction = ...  # seconds per batch of 4, two workers, 20 ms of waiting per image
""",
    answer="two_workers_prediction",
    solution_code="""# A worker waits 4 × 20 ms = 80 ms for each batch it builds; two workers wait side by side, so a batch arrives every
# 80 / 2 = 40 ms (the CPU time per batch is far below that).
two_workers_prediction = 4 * 0.02 / 2
""",
    hints=(
        "how long does one worker take to build a batch of 4 images, each waiting 20 ms?",
        "80 ms a batch for one worker; the two workers build different batches at the same time",
        "4 × 0.02 / 2",
    ),
    wrong_answers=(
        WrongAnswer("two_workers_prediction = 4 * 0.02", "two workers wait side by side"),
        WrongAnswer("two_workers_prediction = 4 * 0.02 / 4", "half the measured"),
        WrongAnswer("two_workers_prediction = 0.02 / 2", "per image"),
    ),
    measure=_measure_two_workers,
    what="the measured seconds per batch",
    unit=" s",
    floor=0.2,  # the CPU work per batch and the workers' handing over add a little to the waits
    mistakes=(
        Mistake(2.0, "twice the measured: that is one process; two workers wait side by side, each for its own batch"),
        Mistake(0.5, "half the measured: two workers halve the time a batch takes, not quarter it"),
        Mistake(1 / WORKER_BATCH, f"that is per image: give the seconds per batch of {WORKER_BATCH}"),
    ),
)


# --- 2 · fix it: an input-bound loop --------------------------------------------------------------------------------

FEED_WAIT, FEED_BATCH, FEED_IMAGES = 0.01, 8, 64


def _judge_feeding(make_loader) -> Verdict:
    slow = data.SlowDataset(data.shapes(FEED_IMAGES, 0, seed=0)[0], FEED_WAIT)
    loader = make_loader(slow, FEED_BATCH)
    images = next(iter(loader))[0]
    if tuple(images.shape) != (FEED_BATCH, 3, 32, 32):
        return Verdict(
            False,
            f"your loader's batches are {tuple(images.shape)}, not ({FEED_BATCH}, 3, 32, 32): keep "
            "the batch and the images, change how they are read",
        )
    model = models.fast_cnn(8)
    diagnosis = data.diagnose(loader, model, steps=4, warmup=1, device=detect().device)
    shown = (
        f"{diagnosis.verdict}: the loader alone {diagnosis.loader_steps_per_second:.3g} batches/s, the step "
        f"alone {diagnosis.step_steps_per_second:.3g}/s; {diagnosis.data_wait_fraction:.0%} of the time waiting"
    )
    if not diagnosis.input_bound:
        return Verdict(True, shown)
    return Verdict(
        False,
        f"{shown}: still input-bound: the loader must deliver batches faster than the step uses "
        "them: read each image's wait in parallel with more workers, or read them once and keep "
        "them in memory",
    )


feed_the_step = Exercise(
    key="02.feed_the_step",
    kind="fix",
    title="an input-bound loop made compute-bound",
    prompt=f"""### Exercise 2 · Fix it: the step waits for data

`make_loader(slow_dataset, batch_size)` returns the loader a training loop reads. Its dataset sits on slow storage
({FEED_WAIT * 1e3:.0f} ms per image, `gk.data.SlowDataset`) and, as shipped, one process reads it image by image:
`gk.data.diagnose` calls the loop **input-bound**. **Change `make_loader` so that the loop is compute-bound**, with
the same batches of {FEED_BATCH} images from `slow_dataset` (section 4 lists what to try). The check builds your
loader on a dataset of {FEED_IMAGES} images and runs `gk.data.diagnose` on it with a small CNN.""",
    starter="""def make_loader(slow_dataset, batch_size):
    return torch.utils.data.DataLoader(slow_dataset, batch_size=batch_size, shuffle=True)
""",
    answer="make_loader",
    solution_code="""def make_loader(slow_dataset, batch_size):
    # Read every image once (the slow part, 64 × 10 ms) and keep them in memory: each epoch then costs no waiting.
    # (Many workers would overlap the waits too, as long as they outpace the step, which a fast GPU may not allow.)
    in_memory = [slow_dataset[index] for index in range(len(slow_dataset))]
    return torch.utils.data.DataLoader(in_memory, batch_size=batch_size, shuffle=True)
""",
    hints=(
        "diagnose says the loader alone is slower than the step: what makes each batch slow, and what can overlap it?",
        "the waits use no CPU: several worker processes can wait at once; or pay every image's wait only once",
        "read [slow_dataset[i] for i in range(len(slow_dataset))] once and give the DataLoader that list",
    ),
    wrong_answers=(
        WrongAnswer(
            """def make_loader(slow_dataset, batch_size):
    return torch.utils.data.DataLoader(slow_dataset, batch_size=batch_size, shuffle=True, num_workers=1)
""",
            "still input-bound",
        ),
        WrongAnswer(
            """def make_loader(slow_dataset, batch_size):
    return torch.utils.data.DataLoader(slow_dataset, batch_size=batch_size // 4, shuffle=True)
""",
            "keep the batch and the images",
        ),
    ),
    judge=_judge_feeding,
)


EXERCISES = (two_workers, feed_the_step)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
