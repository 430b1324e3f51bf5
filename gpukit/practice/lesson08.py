"""Lesson 08's exercises (optimizers and large batches): AdamW's state against SGD's, a large-batch run whose
learning rate makes it diverge, fixed, and parameter groups that keep weight decay off biases and norms."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import models, optim
from ..env import detect, seed_everything
from ..train import fit
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "08_optimizers_and_large_batches"
BEFORE = "## What we measured"


# --- 1 · predict: AdamW's state against SGD's --------------------------------------------------------------------


def _state_bytes(name: str) -> int:
    # One real step of the named optimizer (gk.optim.make_optimizer, as fit builds it), then every tensor it keeps.
    seed_everything(0)
    model = models.fast_cnn(8)
    optimizer = optim.make_optimizer(name, model, lr=0.01, weight_decay=0.0)
    model(torch.randn(4, 3, 32, 32)).sum().backward()
    optimizer.step()
    return sum(value.nbytes for state in optimizer.state.values() for value in state.values() if torch.is_tensor(value))


def _measure_state_ratio() -> list[float]:
    return [_state_bytes("adamw") / _state_bytes("nesterov")]


state_ratio = Prediction(
    key="08.state_ratio",
    kind="predict",
    title="AdamW's optimizer state against SGD with momentum",
    prompt="""### Exercise 1 · Predict: how much state

**Predict how many times more bytes of optimizer state AdamW keeps than SGD with Nesterov momentum** (`"adamw"`
against `"nesterov"`, as `gk.fit` builds them) for the same model, `gk.models.fast_cnn(8)`, after their first step
(section 3's table). The check takes a real step of each and counts the tensors in `optimizer.state`.""",
    starter="""state_prediction = ...  # AdamW's state bytes ÷ SGD with momentum's
""",
    answer="state_prediction",
    solution_code="""# SGD with momentum keeps one buffer per parameter; AdamW two (exp_avg and exp_avg_sq), plus a 4-byte step count
# per tensor, negligible next to the buffers.
state_prediction = 2 / 1
""",
    hints=(
        "how many tensors the size of a parameter does each optimizer keep for it?",
        "momentum: one buffer; Adam and AdamW: a first and a second moment",
        "2 / 1",
    ),
    wrong_answers=(
        WrongAnswer("state_prediction = 4", "twice the measured"),
        WrongAnswer("state_prediction = 1", "half the measured"),
    ),
    measure=_measure_state_ratio,
    what="the measured ratio",
    unit="x",
    floor=0.05,
    mistakes=(
        Mistake(2.0, "twice the measured: AdamW keeps two moments per parameter, SGD with momentum one buffer"),
        Mistake(0.5, "half the measured: AdamW keeps a second moment (exp_avg_sq) besides the first"),
        Mistake(1.5, "did you count the gradients as optimizer state? They are not the optimizer's"),
    ),
)


# --- 2 · fix it: a large batch that diverges -----------------------------------------------------------------------

SMALL, LARGE, BASE_LR = 64, 512, 0.1


def _blobs() -> torch.utils.data.TensorDataset:
    """4,096 points of 32 features in 10 overlapping classes: a network learns them in an epoch, not perfectly."""
    generator = torch.Generator().manual_seed(0)
    centers = 0.5 * torch.randn(10, 32, generator=generator)
    labels = torch.randint(0, 10, (4096,), generator=generator)
    return torch.utils.data.TensorDataset(centers[labels] + torch.randn(4096, 32, generator=generator), labels)


def _epoch(batch_size: int, lr: float) -> tuple[float, float]:
    """(first, last) logged loss of one epoch of a small network at `batch_size` and `lr` (SGD, Nesterov)."""
    seed_everything(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 10))
    history = fit(
        model, _blobs(), batch_size=batch_size, epochs=1, lr=lr, log_every=1, progress=False, device=detect().device
    )
    return history.losses[0], sum(history.losses[-3:]) / 3  # the end: the last three steps' mean


def _judge_lr(lr_for) -> Verdict:
    lr = float(lr_for(LARGE))
    start, small_end = _epoch(SMALL, BASE_LR)  # the reference, measured here: batch 64 at its own lr
    _, large_end = _epoch(LARGE, lr)
    progress = (start - large_end) / (start - small_end)  # 1: as far in one epoch as the small batch got
    shown = (
        f"at batch {LARGE} and lr {lr:.3g}, one epoch took the loss from {start:.3g} to {large_end:.3g}: "
        f"{progress:.0%} of the way batch {SMALL} at lr {BASE_LR} went ({small_end:.3g}; allowed 60% or more)"
    )
    if progress >= 0.6:
        return Verdict(True, shown)
    if not large_end < start:
        return Verdict(
            False,
            f"{shown}: it diverged: lr {lr:.3g} is too large; the linear rule scales {BASE_LR} at "
            f"batch {SMALL} by the batch's ratio ({LARGE} / {SMALL})",
        )
    return Verdict(
        False,
        f"{shown}: the large batch takes {LARGE // SMALL}x fewer steps in an epoch, each too small "
        "to make up for them: scale the lr with the batch",
    )


large_batch_lr = Exercise(
    key="08.large_batch_lr",
    kind="fix",
    title="a large-batch run whose learning rate makes it diverge",
    prompt=f"""### Exercise 2 · Fix it: the large batch diverges

A small network trains on 4,096 points with SGD (Nesterov momentum) and `fit`'s warm-up, at lr {BASE_LR} for a batch
of {SMALL}. At batch {LARGE}, `lr_for(batch_size)` below sets the learning rate, and with it the run diverges.
**Fix `lr_for` so that one epoch at batch {LARGE} gets at least 60% as far as one epoch at batch {SMALL}** (the loss
fallen from its start; section 5). The check trains both here and compares.""",
    starter=f"""def lr_for(batch_size):
    return {BASE_LR} * batch_size / 8  # scaled with the batch
""",
    answer="lr_for",
    solution_code=f"""def lr_for(batch_size):
    # The linear scaling rule, from the batch the lr was tuned for ({SMALL}), not from another: k times the batch,
    # k times fewer steps in an epoch, each k times larger; fit's warm-up eases the start.
    return {BASE_LR} * batch_size / {SMALL}
""",
    hints=(
        f"which lr would the linear scaling rule give at batch {LARGE}, starting from {BASE_LR} at batch {SMALL}?",
        f"the shipped rule divides by 8, not by the batch the lr was tuned for ({SMALL}): {LARGE // 8}x, not "
        f"{LARGE // SMALL}x",
        f"return {BASE_LR} * batch_size / {SMALL}",
    ),
    wrong_answers=(
        WrongAnswer(
            f"""def lr_for(batch_size):
    return {BASE_LR}
""",
            "scale the lr with the batch",
        ),
        WrongAnswer(
            f"""def lr_for(batch_size):
    return {BASE_LR} * (batch_size / {SMALL}) ** 2
""",
            "it diverged",
        ),
    ),
    judge=_judge_lr,
)


# --- 3 · build it: no weight decay on biases and norms ------------------------------------------------------------


def _judge_groups(decay_groups) -> Verdict:
    seed_everything(0)
    model, weight_decay, lr = models.fast_cnn(8), 0.1, 0.5
    before = copy.deepcopy(model)
    optimizer = torch.optim.AdamW(decay_groups(model, weight_decay), lr=lr)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)  # no gradient: the step is the weight decay alone
    optimizer.step()
    wrong = []
    for (name, new), old in zip(model.named_parameters(), before.parameters()):
        decayed = not torch.equal(new, old)
        if decayed != (old.dim() > 1):
            wrong.append(f"{name} ({old.dim()}-D: {'decayed' if decayed else 'not decayed'})")
    shown = (
        f"one AdamW step without gradients, measured here, decayed {sum(1 for _ in model.parameters()) - len(wrong)}"
    )
    shown += f" of {sum(1 for _ in model.parameters())} parameters as it should"
    if not wrong:
        return Verdict(True, shown + ": every weight matrix and filter, no bias or norm parameter")
    one_d = [item for item in wrong if "1-D" in item]
    what = (
        "biases and norm parameters must not decay: a group of every 1-D parameter with weight_decay=0"
        if one_d
        else "weight matrices and filters must decay: a group of every parameter of 2 dimensions or "
        "more with weight_decay=weight_decay"
    )
    return Verdict(False, f"{shown}; not so: {', '.join(wrong[:3])}{', ...' if len(wrong) > 3 else ''}: {what}")


no_decay_groups = Exercise(
    key="08.no_decay_groups",
    kind="build",
    title="parameter groups without weight decay on biases and norms",
    prompt="""### Exercise 3 · Build it: parameter groups

Write `decay_groups(model, weight_decay)`: the parameter groups for `torch.optim.AdamW(groups, lr=...)` that decay
every weight matrix and convolution filter by `weight_decay` and no bias or norm parameter (section 1, "no weight
decay on biases and norm parameters", as `gk.optim.make_optimizer` does). The check builds AdamW from your groups for
`gk.models.fast_cnn(8)`, takes a step with zero gradients (the weight decay alone moves the parameters) and looks at
which parameters moved.""",
    starter="""def decay_groups(model, weight_decay):
    ...  # [{"params": [...], "weight_decay": ...}, {"params": [...], "weight_decay": 0.0}]
""",
    answer="decay_groups",
    solution_code="""def decay_groups(model, weight_decay):
    parameters = [parameter for parameter in model.parameters() if parameter.requires_grad]
    # 1-D parameters are biases and the scales and shifts of norms: shrinking them only fights the normalisation.
    return [
        {"params": [parameter for parameter in parameters if parameter.dim() > 1], "weight_decay": weight_decay},
        {"params": [parameter for parameter in parameters if parameter.dim() <= 1], "weight_decay": 0.0},
    ]
""",
    hints=(
        "biases and norm parameters are exactly the 1-D parameters: parameter.dim() tells them apart",
        "two groups: a list of dicts, each with 'params' and its own 'weight_decay'",
        "[{'params': [p with p.dim() > 1], 'weight_decay': weight_decay}, {'params': [the rest], 'weight_decay': 0.0}]",
    ),
    wrong_answers=(
        WrongAnswer(
            """def decay_groups(model, weight_decay):
    return [{"params": list(model.parameters()), "weight_decay": weight_decay}]
""",
            "biases and norm parameters must not decay",
        ),
        WrongAnswer(
            """def decay_groups(model, weight_decay):
    parameters = list(model.parameters())
    return [
        {"params": [p for p in parameters if p.dim() > 2], "weight_decay": weight_decay},
        {"params": [p for p in parameters if p.dim() <= 2], "weight_decay": 0.0},
    ]
""",
            "weight matrices and filters must decay",
        ),
    ),
    judge=_judge_groups,
)


EXERCISES = (state_ratio, large_batch_lr, no_decay_groups)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
