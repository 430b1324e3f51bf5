"""Lesson 04's exercises (many GPUs): the bytes DDP all-reduces with gradient accumulation, and an all-reduce of the
gradients by hand that trains exactly as DDP does. Both launch two worker processes (CPU processes over gloo where
there are fewer than two GPUs), as the lesson does."""

from __future__ import annotations

import torch
from torch import nn

from .. import data, distributed
from ..env import detect
from ..train import fit
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "04_multi_gpu_scaling"
BEFORE = "## Summary"

ACCUMULATE, STEPS, MICRO_BATCH = 4, 3, 8


def _network() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights in every process
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 128), nn.GELU(), nn.Linear(128, 10))


def _launch(fn, *args) -> list:
    env = detect()
    backend, workers = ("nccl", env.gpu_count) if env.gpu_count >= 2 else ("gloo", 2)
    # The first optimizer a process builds imports torch._dynamo (seconds): do it here once, so that forked
    # workers inherit it instead of each importing it again.
    torch.optim.SGD([torch.zeros(1, requires_grad=True)])
    return distributed.launch(
        fn, workers, *args, backend=backend, start_method=distributed.fastest_start_method(), timeout=300
    )


# --- 1 · predict: the bytes DDP all-reduces ------------------------------------------------------------------------


def _count_allreduced(train) -> int:
    worker = distributed.setup()
    model = _network()
    with distributed.count_collectives() as sent:  # every collective this rank issues, at torch's dispatcher
        fit(
            model,
            train,
            batch_size=MICRO_BATCH,
            accumulate=ACCUMULATE,
            max_steps=STEPS,
            lr=0.01,
            device=worker.device,
            progress=False,
            log_every=STEPS,
        )
    distributed.cleanup()
    return sent.bytes("allreduce")


def _measure_allreduced() -> list[float]:
    train = data.shapes(2 * MICRO_BATCH * ACCUMULATE * STEPS, 0, seed=0)[0]
    return [float(count) for count in _launch(_count_allreduced, train)[:1]]  # rank 0's count


allreduced_bytes = Prediction(
    key="04.allreduced_bytes",
    kind="predict",
    title="the bytes DDP all-reduces with gradient accumulation",
    prompt=f"""### Exercise 1 · Predict: what DDP sends

Two ranks train `nn.Flatten()` → `nn.Linear(3072, 128)` → `nn.GELU()` → `nn.Linear(128, 10)` (fp32) with
`gk.fit(..., accumulate={ACCUMULATE}, max_steps={STEPS})`: {STEPS} optimizer steps of {ACCUMULATE} micro-batches each.
**Predict the bytes rank 0 hands to all-reduce in that run** (section 2 says when DDP communicates; the loss `fit`
averages over the ranks for its log is a few bytes). The check launches the two ranks and counts every collective
with `gk.distributed.count_collectives`.""",
    starter="""allreduced_prediction = ...  # bytes rank 0 all-reduces over 3 optimizer steps of 4 micro-batches
""",
    answer="allreduced_prediction",
    solution_code=f"""parameters = (3072 * 128 + 128) + (128 * 10 + 10)
# DDP all-reduces the gradients (4 bytes each in fp32) once per optimizer step: fit runs the other micro-batches of
# each step inside model.no_sync(), so their gradients stay local and add up.
allreduced_prediction = {STEPS} * 4 * parameters
""",
    hints=(
        "what does DDP all-reduce, and how many bytes is it for this model in fp32?",
        "the gradients, once per optimizer step: fit runs the first k - 1 micro-batches of a step inside no_sync()",
        "optimizer steps × 4 bytes × parameters",
    ),
    wrong_answers=(
        WrongAnswer(
            f"allreduced_prediction = {STEPS * ACCUMULATE} * 4 * ((3072 * 128 + 128) + (128 * 10 + 10))",
            "inside no_sync()",
        ),
        WrongAnswer(
            f"allreduced_prediction = {STEPS} * 8 * ((3072 * 128 + 128) + (128 * 10 + 10))", "twice the counted"
        ),
    ),
    measure=_measure_allreduced,
    what="the counted bytes",
    unit=" bytes",
    floor=0.05,  # fit's logged loss, averaged over the ranks, adds a few bytes
    mistakes=(
        Mistake(
            float(ACCUMULATE),
            "once per micro-batch? fit runs the first k - 1 micro-batches of each step inside "
            "no_sync(): DDP all-reduces once per optimizer step",
        ),
        Mistake(2.0, "twice the counted: the gradients are fp32, 4 bytes each; all_reduce is handed each one once"),
        Mistake(0.5, "half the counted: the gradients are fp32 (4 bytes), not 16-bit"),
    ),
)


# --- 2 · build it: all-reduce the gradients by hand ----------------------------------------------------------------

HAND_STEPS = 3


def _train_both_ways(average_gradients) -> dict:
    worker = distributed.setup()
    generator = torch.Generator().manual_seed(worker.rank)  # each rank its own images
    batches = [
        (torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator))
        for _ in range(HAND_STEPS)
    ]
    by_hand, ddp = _network().to(worker.device), distributed.data_parallel(_network().to(worker.device))
    start = [parameter.detach().clone() for parameter in by_hand.parameters()]
    for model in (by_hand, ddp):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for images, labels in batches:
            images, labels = images.to(worker.device), labels.to(worker.device)
            nn.functional.cross_entropy(model(images), labels).backward()
            if model is by_hand:
                average_gradients(model)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    distributed.cleanup()
    moved = [(a.detach() - s).cpu() for a, s in zip(by_hand.parameters(), start)]
    ddp_moved = [(b.detach() - s).cpu() for b, s in zip(ddp.module.parameters(), start)]
    return {"by_hand": moved, "ddp": ddp_moved}


def _judge_allreduce(average_gradients) -> Verdict:
    ranks = _launch(_train_both_ways, average_gradients)
    flat = [torch.cat([t.flatten() for t in rank["by_hand"]]) for rank in ranks]
    ddp = torch.cat([t.flatten() for t in ranks[0]["ddp"]])
    disagree = max((moved - flat[0]).abs().max().item() for moved in flat)
    difference = (flat[0] - ddp).abs().max().item()
    shown = (
        f"after {HAND_STEPS} steps your ranks differ by {disagree:.2g} and rank 0 differs from DDP by "
        f"{difference:.2g} (allowed 1e-5)"
    )
    if disagree <= 1e-5 and difference <= 1e-5:
        return Verdict(True, shown)
    if disagree > 1e-5:
        return Verdict(
            False,
            f"{shown}: the ranks ended with different parameters: each stepped with its own "
            "gradient; all-reduce every gradient, so that all ranks hold the same one",
        )
    size = (flat[0].norm() / ddp.norm()).item()
    if abs(size - len(ranks)) < 0.1 * len(ranks):
        return Verdict(
            False,
            f"{shown}: your updates are {size:.2f}x DDP's: all_reduce sums the gradients; divide "
            "by the world size for their mean",
        )
    return Verdict(
        False,
        f"{shown}: your updates are {size:.2f}x DDP's: every rank must step with the mean of all ranks' gradients",
    )


allreduce_by_hand = Exercise(
    key="04.allreduce_by_hand",
    kind="build",
    title="an all-reduce of the gradients by hand, equal to DDP",
    prompt=f"""### Exercise 2 · Build it: data parallelism by hand

Write `average_gradients(model)`: called in every rank after `loss.backward()` and before `optimizer.step()`, it
must leave in each parameter's `.grad` the **mean of that gradient over all ranks**, as DDP does (section 2), with
`torch.distributed` (the process group is set up; `torch.distributed.get_world_size()` says how many ranks there
are). The check launches two ranks, each with its own images, trains a small network {HAND_STEPS} steps with your
function and the same network under DDP, and compares.""",
    starter="""def average_gradients(model):
    ...  # each parameter's .grad becomes its mean over all ranks
""",
    answer="average_gradients",
    solution_code="""def average_gradients(model):
    world_size = torch.distributed.get_world_size()
    for parameter in model.parameters():
        torch.distributed.all_reduce(parameter.grad)  # in place: the sum over the ranks, on every rank
        parameter.grad /= world_size  # the mean: DDP averages
""",
    hints=(
        "torch.distributed.all_reduce(tensor) replaces a tensor, on every rank, by a reduction over the ranks",
        "its default reduction is the sum; DDP's gradient is the mean over the ranks",
        "for each parameter: all_reduce(parameter.grad), then parameter.grad /= torch.distributed.get_world_size()",
    ),
    wrong_answers=(
        WrongAnswer(
            """def average_gradients(model):
    for parameter in model.parameters():
        torch.distributed.all_reduce(parameter.grad)
""",
            "divide by the world size",
        ),
        WrongAnswer(
            """def average_gradients(model):
    for parameter in model.parameters():
        parameter.grad /= torch.distributed.get_world_size()
""",
            "the ranks ended with different parameters",
        ),
    ),
    judge=_judge_allreduce,
)


EXERCISES = (allreduced_bytes, allreduce_by_hand)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
