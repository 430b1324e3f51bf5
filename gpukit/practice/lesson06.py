"""Lesson 06's exercises (your own model and data): a regression loss that trains to the mean, fixed, and a metric
of your own that `fit` reports as its definition says."""

from __future__ import annotations

import torch
from torch import nn

from ..env import detect, seed_everything
from ..train import fit
from .exercise import Exercise, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "06_bring_your_own_model_and_data"
BEFORE = "## What you can take to your own notebook"


def _table(rows: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """A regression table: 5 standardised columns and a target (N,), mostly linear in them, with noise."""
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(rows, 5, generator=generator)
    target = features @ torch.tensor([1.0, -2.0, 0.5, 0.0, 1.5]) + 0.5 * torch.tanh(3 * features[:, 0])
    target = target + 0.3 * torch.randn(rows, generator=generator)
    return features, (target - target.mean()) / target.std()


def _regressor() -> nn.Module:
    seed_everything(0)
    return nn.Sequential(nn.Linear(5, 32), nn.GELU(), nn.Linear(32, 1))  # outputs (B, 1)


# --- 1 · fix it: a loss that trains to the mean ---------------------------------------------------------------------


def _judge_loss(my_loss) -> Verdict:
    features, target = _table()
    split = 768
    model = _regressor()
    fit(
        model,
        torch.utils.data.TensorDataset(features[:split], target[:split]),
        batch_size=64,
        epochs=5,
        lr=1e-2,
        optimizer="adamw",
        loss_fn=my_loss,
        progress=False,
        device=detect().device,
    )
    model.eval()
    with torch.no_grad():
        predicted = model(features[split:].to(detect().device)).cpu()[:, 0]
    held_out = target[split:]
    ratio = (((predicted - held_out) ** 2).mean() / held_out.var(unbiased=False)).item()
    shown = f"the held-out squared error, measured here, is {ratio:.2f}x the target's variance (allowed below 0.5)"
    if ratio < 0.5:
        return Verdict(True, shown)
    values = torch.arange(4.0)  # targets (B,), and outputs (B, 1) that equal them, as fit passes them
    if abs(float(my_loss(values[:, None], values))) > 1e-6:
        return Verdict(
            False,
            f"{shown}: your loss is not 0 where every output equals its target: outputs are (B, 1) "
            "and targets (B,), so "
            "outputs - target broadcasts to (B, B): every output is pulled towards every target; "
            "compare outputs[:, 0] (or outputs.squeeze(1)) with the target",
        )
    return Verdict(False, f"{shown}: the loss must be smallest where each output equals its own target")


regression_loss = Exercise(
    key="06.regression_loss",
    kind="fix",
    title="a regression loss that trains to the mean",
    prompt="""### Exercise 1 · Fix it: the regression that learns nothing

`my_loss(outputs, target)` is a mean squared error written by hand, passed to `gk.fit(..., loss_fn=my_loss)`. The
model ends in `nn.Linear(32, 1)`, so its outputs are (B, 1); the table's target is a vector, (B,). As shipped,
training runs without an error and the model learns nothing: its held-out error is that of always predicting the
mean. **Fix `my_loss`.** The check trains a small network on a table with it and measures the held-out error.""",
    starter="""def my_loss(outputs, target):
    return ((outputs - target) ** 2).mean()
""",
    answer="my_loss",
    solution_code="""def my_loss(outputs, target):
    # outputs (B, 1), target (B,): outputs - target would broadcast to (B, B), every output against every target.
    return ((outputs[:, 0] - target) ** 2).mean()
""",
    hints=(
        "print the shape of outputs - target for outputs of shape (4, 1) and a target of shape (4,)",
        "(4, 1) - (4,) broadcasts to (4, 4): each output is compared with every target, whose best answer is the mean",
        "compare outputs[:, 0] (or outputs.squeeze(1)) with the target",
    ),
    wrong_answers=(
        WrongAnswer(
            """def my_loss(outputs, target):
    return ((outputs - target) ** 2).sum() / len(target)
""",
            "broadcasts to (B, B)",
        ),
        WrongAnswer(
            """def my_loss(outputs, target):
    return (outputs[:, 0] - target).mean()
""",
            "smallest where each output equals its own target",
        ),
    ),
    judge=_judge_loss,
)


# --- 2 · build it: a metric of your own -----------------------------------------------------------------------------


def _judge_metric(within_half) -> Verdict:
    features, target = _table()
    split = 768
    held_out = torch.utils.data.TensorDataset(features[split:], target[split:, None])
    model = _regressor()
    history = fit(
        model,
        torch.utils.data.TensorDataset(features[:split], target[:split, None]),
        batch_size=64,
        epochs=1,
        lr=1e-2,
        optimizer="adamw",
        loss_fn="mse",
        metrics={"within_half": within_half},
        eval_data=held_out,
        progress=False,
        device=detect().device,
    )
    model.eval()
    with torch.no_grad():
        outputs = model(features[split:].to(detect().device)).cpu()
    by_hand = ((outputs - target[split:, None]).abs() < 0.5).float().mean().item()  # all held-out rows at once
    reported = float(history.final("eval_within_half"))
    shown = f"fit reported {reported:.4g}, the share measured here on all held-out rows is {by_hand:.4g}"
    if abs(reported - by_hand) <= 1e-6:
        return Verdict(True, shown)
    ratio = reported / by_hand if by_hand else float("inf")
    if 100 * by_hand - 1e-3 <= reported <= 100 * by_hand + 1e-3:
        return Verdict(False, f"{shown}: 100x: give a fraction between 0 and 1, not a percentage")
    if ratio > 2:
        return Verdict(
            False,
            f"{shown} ({ratio:.3g}x): fit averages your metric over the samples of each batch, "
            "weighting each batch by its size: return the batch's mean, not its sum",
        )
    return Verdict(False, f"{shown}: count the rows whose |output - target| is below 0.5, over the rows of the batch")


own_metric = Exercise(
    key="06.own_metric",
    kind="build",
    title="a metric of your own, as fit reports it",
    prompt="""### Exercise 2 · Build it: your own metric

Write `within_half(outputs, target)`: the **share of rows whose prediction is within 0.5 of the target** (a number
from 0 to 1), for a batch of outputs (B, 1) and targets (B, 1). `fit(..., metrics={"within_half": within_half})`
computes it on every batch and reports its average over the samples (section 2). The check trains a small
regressor with your metric and compares `fit`'s held-out figure with the share measured on all held-out rows at
once.""",
    starter="""def within_half(outputs, target):
    ...  # the share of rows (0 to 1) with |output - target| < 0.5
""",
    answer="within_half",
    solution_code="""def within_half(outputs, target):
    close = (outputs - target).abs() < 0.5  # (B, 1) booleans
    return close.float().mean()  # the batch's share: fit weights it by the batch's size
""",
    hints=(
        "(outputs - target).abs() < 0.5 says, row by row, whether the prediction is close enough",
        "fit averages what you return over the batches, weighted by their sizes: return the batch's share",
        "return ((outputs - target).abs() < 0.5).float().mean()",
    ),
    wrong_answers=(
        WrongAnswer(
            """def within_half(outputs, target):
    return ((outputs - target).abs() < 0.5).float().sum()
""",
            "return the batch's mean, not its sum",
        ),
        WrongAnswer(
            """def within_half(outputs, target):
    return 100 * ((outputs - target).abs() < 0.5).float().mean()
""",
            "not a percentage",
        ),
    ),
    judge=_judge_metric,
)


EXERCISES = (regression_loss, own_metric)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
