"""Lesson 09's exercises (channels_last and serving): where channels_last puts each number in memory, and a serving
function whose answers depend on the batch, fixed."""

from __future__ import annotations

import copy

import torch

from .. import models
from ..env import detect, seed_everything
from .exercise import Exercise, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "09_channels_last_and_compile"
BEFORE = "## What to take away"

SHAPE = (8, 3, 32, 32)  # (N, C, H, W)


# --- 1 · predict: channels_last's strides ------------------------------------------------------------------------


def _judge_strides(strides) -> Verdict:
    measured = torch.empty(SHAPE, device=detect().device).to(memory_format=torch.channels_last).stride()
    try:
        answer = tuple(int(value) for value in strides)
    except (TypeError, ValueError):
        return Verdict(False, f"give the strides as a tuple of 4 integers (N, C, H, W), not {strides!r}")
    shown = f"your strides {answer}, measured here {tuple(measured)}"
    if answer == tuple(measured):
        return Verdict(True, shown)
    n, c, h, w = SHAPE
    if answer == (c * h * w, h * w, w, 1):
        return Verdict(
            False,
            f"{shown}: those are the default layout's (NCHW): in channels_last, C moves fastest: "
            "the C values of one pixel sit next to each other",
        )
    return Verdict(
        False,
        f"{shown}: a stride is how many numbers apart in memory two neighbours along a dimension "
        "are; channels_last stores N, H, W, C from slowest to fastest",
    )


channels_last_strides = Exercise(
    key="09.channels_last_strides",
    kind="predict",
    title="where channels_last puts each number",
    prompt=f"""### Exercise 1 · Predict: channels_last in memory

A batch of images of shape {SHAPE} (N, C, H, W), converted with `.to(memory_format=torch.channels_last)`, keeps its
shape and indexing (section 1). **Predict its strides**: for each of N, C, H and W, how many numbers apart in memory
two neighbours along that dimension are (what `tensor.stride()` returns). The check converts such a tensor here and
reads them.""",
    starter="""strides_prediction = ...  # (N, C, H, W) strides of an 8 × 3 × 32 × 32 batch in channels_last
""",
    answer="strides_prediction",
    solution_code="""n, c, h, w = 8, 3, 32, 32
# channels_last stores the numbers in the order N, H, W, C (C fastest): the C values of a pixel are neighbours, the
# next pixel along W is C numbers on, the next row W·C, the next image H·W·C.
strides_prediction = (h * w * c, 1, w * c, c)
""",
    hints=(
        "in memory, channels_last orders the dimensions N, H, W, C, from slowest to fastest",
        "the fastest dimension has stride 1; each slower one's stride is the product of the sizes of the faster ones",
        "C: 1; W: C; H: W·C; N: H·W·C, written in the order (N, C, H, W)",
    ),
    wrong_answers=(
        WrongAnswer("strides_prediction = (3 * 32 * 32, 32 * 32, 32, 1)", "those are the default layout's (NCHW)"),
        WrongAnswer("strides_prediction = (3 * 32 * 32, 1, 3, 32 * 3)", "a stride is how many numbers apart"),
    ),
    judge=_judge_strides,
)


# --- 2 · fix it: a serving function whose answers depend on the batch ----------------------------------------------


def _judge_serving(serve) -> Verdict:
    device = detect().device
    seed_everything(0)
    model = models.fast_cnn(8).to(device)
    model.train()  # as a model comes out of training
    with torch.no_grad():  # statistics a trained model would have gathered: not BatchNorm's 0 and 1
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-0.5, 0.5)
                module.running_var.uniform_(0.5, 2.0)
    before = copy.deepcopy(model.state_dict())
    requests = torch.randn(16, 3, 32, 32, generator=torch.Generator().manual_seed(1)).to(device)
    together = serve(model, requests)  # request 0 served in a batch of 16
    alone = serve(model, requests[:1])  # and alone
    moved = [name for name, value in model.state_dict().items() if not torch.equal(value, before[name])]
    difference = (together[:1] - alone).abs().max().item()
    allowed = 1e-3 * (1 + alone.abs().max().item())  # a GPU may convolve a batch of 1 and of 16 by other algorithms
    shown = f"request 0's answer alone and in a batch of 16 differ by {difference:.2g} (allowed {allowed:.2g})"
    if moved:
        return Verdict(
            False,
            f"{shown}, and serving changed the model ({moved[0]}, …): in training mode, BatchNorm "
            "normalises with each batch's statistics and updates its running ones: call "
            "model.eval() before serving",
        )
    if difference > allowed:
        return Verdict(False, f"{shown}: an answer must not depend on the requests served beside it: model.eval()")
    if together.requires_grad:
        return Verdict(
            False,
            f"{shown}, but the answers carry an autograd graph (requires_grad): serving builds the "
            "graph a backward pass would need, for nothing: wrap the call in "
            "torch.inference_mode()",
        )
    return Verdict(True, f"{shown}; the model is unchanged and no autograd graph was built")


serving = Exercise(
    key="09.serving",
    kind="fix",
    title="a serving function whose answers depend on the batch",
    prompt="""### Exercise 2 · Fix it: answers that depend on the batch

`serve(model, images)` answers a batch of requests with a model straight out of training. As shipped, a request's
answer changes with the other requests served beside it, serving changes the model, and it builds an autograd graph
nobody uses. **Fix `serve`** (section 4 says how `gk.inference.measure` runs a model). The check serves a trained
CNN's request alone and in a batch, compares the answers, and compares the model before and after.""",
    starter="""def serve(model, images):
    return model(images)
""",
    answer="serve",
    solution_code="""def serve(model, images):
    model.eval()  # BatchNorm uses the statistics it learned, not the batch's; dropout is off
    with torch.inference_mode():  # no autograd graph: nothing will run backward
        return model(images)
""",
    hints=(
        "which layers of a CNN behave differently in training and in evaluation?",
        "BatchNorm in training mode normalises with the batch's own statistics and updates its running ones",
        "model.eval(), and the call inside torch.inference_mode()",
    ),
    wrong_answers=(
        WrongAnswer(
            """def serve(model, images):
    with torch.inference_mode():
        return model(images)
""",
            "call model.eval() before serving",
        ),
        WrongAnswer(
            """def serve(model, images):
    model.eval()
    return model(images)
""",
            "wrap the call in torch.inference_mode()",
        ),
    ),
    judge=_judge_serving,
)


EXERCISES = (channels_last_strides, serving)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
