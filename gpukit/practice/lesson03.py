"""Lesson 03's exercises (memory): count a model's state, predict a block's saved activations, make a step fit a
budget without changing the batch, and accumulate gradients by hand."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import memory, models
from ..env import detect, seed_everything
from ..report import format_bytes
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "03_memory_troubleshooting"
BEFORE = "## What to take away"


# --- 1 · predict: what grows with the model --------------------------------------------------------------------


def _classifier() -> nn.Module:
    seed_everything(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(3 * 32 * 32, 256), nn.ReLU(), nn.Linear(256, 10))


def _measure_model_state() -> list[float]:
    # One real AdamW step (measured by gk.memory.breakdown, second step): the bytes of the tensors it holds for the
    # parameters, their gradients and AdamW's state, counted from the tensors themselves.
    images = torch.randn(8, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    parts = memory.breakdown(_classifier(), images, optimizer="adamw", device=detect().device)
    return [float(parts.params + parts.grads + parts.optimizer_state)]


model_state = Prediction(
    key="03.model_state",
    kind="predict",
    title="the bytes of weights, gradients and AdamW state",
    prompt="""### Exercise 1 · Predict: what grows with the model

A classifier of 32×32 RGB images: `nn.Flatten()`, `nn.Linear(3072, 256)`, `nn.ReLU()`, `nn.Linear(256, 10)`, trained
in fp32 with AdamW. **Predict, in bytes**, what one training step keeps for the model itself: its parameters, their
gradients and AdamW's state (ignore the activations). Work it out by hand from the layer shapes; the check trains
the model for a step here and counts the tensors.""",
    starter="""model_state_prediction = ...  # bytes: parameters + gradients + AdamW's state, worked out by hand
""",
    answer="model_state_prediction",
    solution_code="""parameters = (3072 * 256 + 256) + (256 * 10 + 10)  # weights and biases of the two Linear layers
# fp32: 4 bytes a number; one copy for the weights, one for their gradients, two for AdamW's moments (exp_avg,
# exp_avg_sq); AdamW also keeps a 4-byte step count per parameter tensor (4 tensors), which is negligible here.
model_state_prediction = 4 * 4 * parameters + 4 * 4
""",
    hints=(
        "count the parameters of each Linear layer (in × out weights, plus out biases), then the copies a step keeps",
        "fp32 is 4 bytes a number; a step keeps the weights, one gradient per weight, and AdamW two moments per weight",
        "4 copies × 4 bytes × (3072·256 + 256 + 256·10 + 10) parameters",
    ),
    wrong_answers=(
        WrongAnswer(
            "model_state_prediction = 2 * 4 * 4 * ((3072 * 256 + 256) + (256 * 10 + 10))",
            "fp32 takes 4 bytes a number, not 8",
        ),
        WrongAnswer("model_state_prediction = 4 * 4 * ((3072 * 256 + 256) + (256 * 10 + 10)) / 2", "2 bytes a number"),
        WrongAnswer(
            "model_state_prediction = 3 * 4 * ((3072 * 256 + 256) + (256 * 10 + 10))", "one copy of the weights short"
        ),
    ),
    measure=_measure_model_state,
    what="the measured state",
    unit=" bytes",
    floor=0.01,
    mistakes=(
        Mistake(2.0, "twice the measured: fp32 takes 4 bytes a number, not 8"),
        Mistake(
            0.5, "half the measured: did you count 2 bytes a number (fp32 takes 4), or leave out AdamW's two moments?"
        ),
        Mistake(0.75, "one copy of the weights short: a step keeps the gradients, and AdamW two moments per weight"),
        Mistake(1.25, "one copy of the weights too many: did you count the gradients twice, or three moments?"),
        Mistake(8.0, "8x the measured: did you count bits instead of bytes?"),
    ),
)


# --- 2 · predict: the saved activations of a block --------------------------------------------------------------

BLOCK_CHANNELS, BLOCK_BATCH = 16, 8


def _measure_block_activations() -> list[float]:
    # Saved-tensor hooks see every tensor autograd keeps for backward in one real forward pass (gk.memory.saved_bytes:
    # each storage once, parameters and buffers excluded); the loss is a mean, which saves nothing.
    seed_everything(0)
    block = nn.Sequential(
        nn.Conv2d(BLOCK_CHANNELS, BLOCK_CHANNELS, 3, padding=1), nn.BatchNorm2d(BLOCK_CHANNELS), nn.GELU()
    )
    inputs = torch.randn(BLOCK_BATCH, BLOCK_CHANNELS, 32, 32)
    saved = memory.saved_bytes(
        block,
        (inputs, torch.zeros(BLOCK_BATCH)),
        loss_fn=lambda outputs, target: outputs.mean(),
        device=detect().device,
    )
    return [float(saved)]


block_activations = Prediction(
    key="03.block_activations",
    kind="predict",
    title="the activations a conv block saves for backward",
    prompt=f"""### Exercise 2 · Predict: the activations a block saves

The block `nn.Conv2d(16, 16, 3, padding=1)` → `nn.BatchNorm2d(16)` → `nn.GELU()`, in training mode, fp32, on a batch
of {BLOCK_BATCH} inputs of 16 channels × 32 × 32. **Predict the bytes its forward pass saves for the backward pass**
(section 1's table says what each kind of layer keeps; weights are not activations). The check runs the block here
and counts what autograd saves.""",
    starter="""block_prediction = ...  # bytes saved for backward by Conv2d → BatchNorm2d → GELU on 8 × 16 × 32 × 32
""",
    answer="block_prediction",
    solution_code="""values = 8 * 16 * 32 * 32  # numbers in one 8 × 16 × 32 × 32 tensor
# The conv keeps its input (for its weights' gradient), BatchNorm its input and two statistics per channel (mean and
# inverse standard deviation), GELU its input (BatchNorm's output): three such tensors of 4-byte numbers.
block_prediction = 3 * 4 * values + 2 * 4 * 16
""",
    hints=(
        "each layer keeps what its backward needs: list what the conv, BatchNorm and GELU each keep",
        "the conv keeps its input, BatchNorm its input (and 2 small statistics per channel), GELU its input: three "
        "tensors of 8·16·32·32 numbers",
        "3 × 4 bytes × 8·16·32·32, plus 2 × 4 bytes × 16 channels",
    ),
    wrong_answers=(
        WrongAnswer("block_prediction = 2 * 4 * 8 * 16 * 32 * 32", "a layer's saved tensor left out"),
        WrongAnswer("block_prediction = 3 * 8 * 8 * 16 * 32 * 32", "fp32 takes 4 bytes a number, not 8"),
        WrongAnswer("block_prediction = 3 * 2 * 8 * 16 * 32 * 32", "2 bytes a number"),
    ),
    measure=_measure_block_activations,
    what="the measured saved bytes",
    unit=" bytes",
    floor=0.05,  # on a GPU cuDNN's BatchNorm keeps its own small statistics
    mistakes=(
        Mistake(2.0, "twice the measured: fp32 takes 4 bytes a number, not 8"),
        Mistake(0.5, "half the measured: did you count 2 bytes a number? Autocast is off: fp32 takes 4"),
        Mistake(2 / 3, "a layer's saved tensor left out: the conv, BatchNorm and GELU each keep their input"),
        Mistake(4 / 3, "one tensor too many: the block's output is not saved (nothing after it needs it)"),
    ),
)


# --- 3 · fix it: fit a memory budget without changing the batch --------------------------------------------------


def _images() -> torch.Tensor:
    batch = detect().profile.batch_size
    return torch.randn(batch, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def _peak(model: nn.Module, precision: str) -> int:
    parts = memory.breakdown(model, _images(), optimizer="adamw", precision=precision, device=detect().device)
    return parts.total - (parts.workspace or 0)  # the tensors: a cuDNN workspace inside one operator is not theirs


def _judge_budget(make_it_fit) -> Verdict:
    width = detect().profile.width
    seed_everything(0)
    shipped = _peak(models.fast_cnn(width), "fp32")
    budget = int(0.75 * shipped)  # a quarter less than the shipped step needs, measured here
    answer = make_it_fit()
    if not (isinstance(answer, tuple) and len(answer) == 2 and isinstance(answer[0], nn.Module)):
        return Verdict(False, f"make_it_fit() must return (model, precision), got {type(answer).__name__}")
    model, precision = answer
    expected = models.count_parameters(models.fast_cnn(width))
    if models.count_parameters(model) != expected:
        return Verdict(
            False,
            f"you changed the model ({models.count_parameters(model):,} parameters, the lesson's "
            f"has {expected:,}): keep the network and the batch, change how the step runs",
        )
    peak = _peak(model, precision)
    shown = f"peak {format_bytes(peak)} against a budget of {format_bytes(budget)} (the shipped step: {format_bytes(shipped)})"
    if peak <= budget:
        return Verdict(True, shown)
    advice = (
        "tf32 changes how fp32 matmuls round, not what is stored"
        if precision == "tf32"
        else "the saved activations are most of this step: store fewer of them, or store them in 16 bits"
    )
    return Verdict(False, f"{shown}: still {peak / budget:.2f}x the budget: {advice}")


fit_the_budget = Exercise(
    key="03.fit_the_budget",
    kind="fix",
    title="make a training step fit a budget without changing the batch",
    prompt="""### Exercise 3 · Fix it: a step that does not fit

`make_it_fit()` below returns the lesson's model and precision for one AdamW training step of the lesson's batch. The
check measures that step here and sets a **budget a quarter below it**: as shipped it does not fit. Change
`make_it_fit` so that the step fits, **without changing the batch or the network** (the same layers and
parameters). Section 5's fixes are the candidates; the check measures the peak of your step.""",
    starter="""def make_it_fit():
    gk.seed_everything(0)
    model = gk.models.fast_cnn(env.profile.width)
    return model, "fp32"  # (model, precision) of one AdamW step of the lesson's batch
""",
    answer="make_it_fit",
    solution_code="""def make_it_fit():
    gk.seed_everything(0)
    model = gk.models.fast_cnn(env.profile.width)
    # Keep only each block's input in the forward pass and recompute the rest in the backward pass: the saved
    # activations, most of this step's memory, shrink; the batch and the weights stay. (precision="bf16-mixed" also
    # fits, where bf16 is fast: on many CPUs it is emulated and slow.)
    gk.memory.apply_activation_checkpointing(model)
    return model, "fp32"
""",
    hints=(
        "look at section 1's table: which part of this step's memory is the largest, and which fixes shrink it?",
        "activations are most of it: activation checkpointing keeps only each block's input",
        "gk.memory.apply_activation_checkpointing(model) before returning it",
    ),
    wrong_answers=(
        WrongAnswer(
            """def make_it_fit():
    gk.seed_everything(0)
    return gk.models.fast_cnn(env.profile.width), "tf32"
""",
            "tf32 changes how fp32 matmuls round",
            needs_gpu=True,
        ),
        WrongAnswer(
            """def make_it_fit():
    gk.seed_everything(0)
    return gk.models.fast_cnn(env.profile.width).to(memory_format=torch.channels_last), "fp32"
""",
            "x the budget: the saved activations are most of this step",
        ),
        WrongAnswer(
            """def make_it_fit():
    gk.seed_everything(0)
    return gk.models.fast_cnn(env.profile.width // 2), "fp32"
""",
            "you changed the model",
        ),
    ),
    judge=_judge_budget,
)


# --- 4 · build it: gradient accumulation by hand -----------------------------------------------------------------

MICRO_BATCHES = 4


def _accumulation_case() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    images = torch.randn(32, 3, 32, 32, generator=generator)
    labels = torch.randint(0, 10, (32,), generator=generator)
    return _classifier(), images, labels


def _gradients(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _judge_accumulation(accumulate) -> Verdict:
    model, images, labels = _accumulation_case()
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(images), labels).backward()  # the whole batch at once
    expected = _gradients(reference)
    seen = []  # the batch size of every forward call the learner's function makes
    model.register_forward_pre_hook(lambda module, inputs: seen.append(len(inputs[0])))
    accumulate(model, images, labels, MICRO_BATCHES)
    got = _gradients(model)
    if max(seen, default=0) > len(images) // MICRO_BATCHES:
        return Verdict(
            False,
            f"a forward pass ran on {max(seen)} images at once: run each micro-batch of "
            f"{len(images) // MICRO_BATCHES} separately, so that only its activations are held",
        )
    error = ((got - expected).norm() / expected.norm()).item()
    shown = f"your gradients differ from the whole batch's by {error:.2g} (relative; allowed 1e-5)"
    if error <= 1e-5:
        return Verdict(True, shown + f", from {len(seen)} forward passes of {max(seen)} images")
    ratio = (got.norm() / expected.norm()).item()
    last = copy.deepcopy(_accumulation_case()[0])
    part = len(images) // MICRO_BATCHES
    nn.functional.cross_entropy(last(images[-part:]), labels[-part:]).backward()
    if min(((got - scale * _gradients(last)).norm() / got.norm()).item() for scale in (1, 1 / MICRO_BATCHES)) < 1e-4:
        return Verdict(
            False,
            f"{shown}: only the last micro-batch's gradient is left: zero the gradients once, "
            "before the loop, not inside it",
        )
    if abs(ratio - MICRO_BATCHES) < 0.01 * MICRO_BATCHES:
        return Verdict(
            False,
            f"{shown}: your gradients are {ratio:.2f}x the whole batch's: the loss is a mean, so "
            f"divide each micro-batch's loss by the number of micro-batches ({MICRO_BATCHES})",
        )
    return Verdict(
        False,
        f"{shown}, {ratio:.2f}x its size: each micro-batch's loss / {MICRO_BATCHES}, backward, "
        "and the gradients add up",
    )


accumulate_by_hand = Exercise(
    key="03.accumulate_by_hand",
    kind="build",
    title="gradient accumulation by hand, equal to the whole batch",
    prompt=f"""### Exercise 4 · Build it: gradient accumulation by hand

Write `accumulate(model, images, labels, micro_batches)`: it must leave in every parameter's `.grad` the gradient of
the mean cross-entropy loss over **all** of `images`, while running the model on only one micro-batch at a time
(`len(images) // micro_batches` images). No optimizer step: the gradients are the result. The check runs it on a
small classifier without BatchNorm (section 5 says why that matters) with {MICRO_BATCHES} micro-batches, and compares
with one backward pass of the whole batch.""",
    starter="""def accumulate(model, images, labels, micro_batches):
    ...  # leave in each parameter's .grad the gradient of the mean loss over all images, one micro-batch at a time
""",
    answer="accumulate",
    solution_code="""def accumulate(model, images, labels, micro_batches):
    model.zero_grad(set_to_none=True)  # once, before the loop: backward adds to .grad
    for part_images, part_labels in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        loss = torch.nn.functional.cross_entropy(model(part_images), part_labels)  # the mean over the micro-batch
        (loss / micro_batches).backward()  # the mean over the whole batch is the mean of the micro-batches' means
""",
    hints=(
        "backward() adds to .grad: run backward once per micro-batch and let the gradients add up",
        "each micro-batch's loss is a mean over its images; the whole batch's is the mean of those means",
        "zero the gradients once before the loop; inside it: loss = cross_entropy(...) / micro_batches; loss.backward()",
    ),
    wrong_answers=(
        WrongAnswer(
            """def accumulate(model, images, labels, micro_batches):
    model.zero_grad(set_to_none=True)
    for part_images, part_labels in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        torch.nn.functional.cross_entropy(model(part_images), part_labels).backward()
""",
            "divide each micro-batch's loss by the number of micro-batches",
        ),
        WrongAnswer(
            """def accumulate(model, images, labels, micro_batches):
    for part_images, part_labels in zip(images.chunk(micro_batches), labels.chunk(micro_batches)):
        model.zero_grad(set_to_none=True)
        (torch.nn.functional.cross_entropy(model(part_images), part_labels) / micro_batches).backward()
""",
            "only the last micro-batch's gradient is left",
        ),
        WrongAnswer(
            """def accumulate(model, images, labels, micro_batches):
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(images), labels).backward()
""",
            "run each micro-batch",
        ),
    ),
    judge=_judge_accumulation,
)


EXERCISES = (model_state, block_activations, fit_the_budget, accumulate_by_hand)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
