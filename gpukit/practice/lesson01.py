"""Lesson 01's exercises (training a CNN): how a step's FLOPs grow with the network's width, and fp16 made to keep
its gradients with loss scaling."""

from __future__ import annotations

import copy

import torch
from torch import nn

from .. import bench, models
from ..env import detect
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "01_train_a_cnn"
BEFORE = "## What to take away"


# --- 1 · predict: FLOPs against width ----------------------------------------------------------------------------


def _measure_width_growth() -> list[float]:
    # torch's FLOP counter on one real training step of each width (gk.bench.flops_per_step), batch of 8 images.
    width = detect().profile.width
    generator = torch.Generator().manual_seed(0)
    batch = (torch.randn(8, 3, 32, 32, generator=generator), torch.randint(0, 10, (8,), generator=generator))
    flops = [bench.flops_per_step(models.fast_cnn(w), batch) for w in (width, 2 * width)]
    return [flops[1] / flops[0]]


width_flops = Prediction(
    key="01.width_flops",
    kind="predict",
    title="how a step's FLOPs grow with the network's width",
    prompt="""### Exercise 1 · Predict: twice the width

`gk.models.fast_cnn(width)` has convolutions of `width`, `2·width` and `4·width` channels (section 1's FLOP count
lists them). **Predict how many times the FLOPs of a training step grow when the width doubles** (`fast_cnn(2 *
width)` against `fast_cnn(width)`, the same images), as a ratio. The check counts both steps' FLOPs with torch's
counter.""",
    starter="""width_prediction = ...  # FLOPs of a step of fast_cnn(2 * width) ÷ those of fast_cnn(width)
""",
    answer="width_prediction",
    solution_code="""# A 3×3 conv costs 2·9·Cin·Cout per output pixel: doubling the width doubles both Cin and Cout of every inner conv,
# 4x. The first conv (3 colour channels in) and the classifier (10 classes out) grow only 2x, but they are a small
# share of the FLOPs: a little under 4x in all.
width_prediction = 4.0
""",
    hints=(
        "how do a convolution's FLOPs depend on its input and output channels?",
        "2·9·Cin·Cout·H·W per image: which of Cin and Cout double when the width doubles?",
        "both, for every conv but the first (3 channels in): about 2 × 2",
    ),
    wrong_answers=(
        WrongAnswer("width_prediction = 2.0", "both its input and its output channels double"),
        WrongAnswer("width_prediction = 8.0", "twice the counted"),
    ),
    measure=_measure_width_growth,
    what="the counted ratio",
    unit="x",
    floor=0.05,
    mistakes=(
        Mistake(0.5, "a conv's FLOPs grow with Cin × Cout, and both its input and its output channels double"),
        Mistake(2.0, "twice the counted: Cin and Cout double, 2 × 2; the image size does not change"),
    ),
)


# --- 2 · fix it: fp16 that loses its gradients --------------------------------------------------------------------

MARGIN = 16  # logit of the right class above the others: a confident model, whose loss and gradients are tiny


def _confident_model() -> tuple[nn.Module, torch.Tensor, torch.Tensor]:
    """A classifier already right about its batch with a margin of MARGIN logits: its loss (~1e-6) and gradients are
    far below fp16's smallest number, as a trained model's are on the examples it knows (lesson 01, section 4)."""
    generator = torch.Generator().manual_seed(0)
    labels = torch.randint(0, 16, (1024,), generator=generator)
    inputs = nn.functional.one_hot(labels, 16).float() * (MARGIN / 3) + 0.1 * torch.randn(1024, 16, generator=generator)
    model = nn.Linear(16, 16)
    with torch.no_grad():
        model.weight.copy_(3 * torch.eye(16))
        model.bias.zero_()
    device = detect().device
    return model.to(device), inputs.to(device), labels.to(device)


def _gradients(model: nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _judge_scaling(backward_in_fp16) -> Verdict:
    model, inputs, labels = _confident_model()
    reference = copy.deepcopy(model)
    nn.functional.cross_entropy(reference(inputs), labels).backward()  # fp32: the gradients fp16 should keep
    expected = _gradients(reference)
    dtypes = []
    model.register_forward_hook(lambda layer, args, output: dtypes.append(output.dtype))
    backward_in_fp16(model, inputs, labels)
    if dtypes != [torch.float16]:
        return Verdict(
            False,
            f"your forward pass ran in {dtypes or 'nothing'}, not once in float16: keep fp16 "
            "autocast (bf16 would need no scaling: fp16 does, and that is the exercise)",
        )
    got = _gradients(model)
    nonzero = expected != 0
    lost = ((got == 0) & nonzero).sum().item() / nonzero.sum().item()
    error = ((got - expected).norm() / expected.norm()).item()
    shown = f"fp16 lost {lost:.1%} of the gradients fp32 has, and the rest differ by {error:.2g} (relative)"
    if lost <= 0.01 and error <= 0.01:
        return Verdict(True, shown + " (allowed 1% and 0.01)")
    size = (got.norm() / expected.norm()).item()
    if lost <= 0.01 and size > 2:
        return Verdict(
            False,
            f"{shown}: your gradients are {size:.3g}x fp32's: divide them by the scale after "
            "backward (GradScaler.unscale_ does)",
        )
    return Verdict(
        False,
        f"{shown}: the gradients here are far below 2^-24, fp16's smallest number: multiply the loss "
        "by a large scale before backward (GradScaler starts at 2^16), divide the gradients by it "
        "after",
    )


loss_scaling = Exercise(
    key="01.loss_scaling",
    kind="fix",
    title="fp16 that keeps its gradients",
    prompt=f"""### Exercise 2 · Fix it: fp16 loses the gradients

`backward_in_fp16(model, inputs, labels)` below runs the forward pass under fp16 autocast and the backward pass, and
must leave in each parameter's `.grad` the gradient of the mean cross-entropy loss. The check gives it a classifier
that is already right about its batch by a margin of {MARGIN} logits, like a trained model on the examples it knows:
its gradients are tiny. As shipped, fp16 rounds most of them to zero. **Change `backward_in_fp16` so that fp16 keeps
them**, still in fp16 (section 4 shows how). The check counts, against an fp32 backward pass, the gradients lost and
how far the rest are off.""",
    starter="""def backward_in_fp16(model, inputs, labels):
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    loss.backward()
""",
    answer="backward_in_fp16",
    solution_code="""def backward_in_fp16(model, inputs, labels):
    scale = 2.0**16  # GradScaler's starting scale: lifts gradients of ~1e-9 into fp16's range
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    (loss * scale).backward()  # every gradient on the way back is `scale` times larger
    for parameter in model.parameters():
        parameter.grad /= scale  # in fp32 (the parameters' gradients are fp32): back to the true gradient
""",
    hints=(
        "the gradients are smaller than fp16's smallest number: what if the loss were larger?",
        "multiply the loss by a scale before backward: every gradient is then that many times larger",
        "(loss * 2**16).backward(), then divide every parameter's .grad by 2**16",
    ),
    wrong_answers=(
        WrongAnswer(
            """def backward_in_fp16(model, inputs, labels):
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    (loss * 2.0**16).backward()
""",
            "divide them by the scale after backward",
        ),
        WrongAnswer(
            """def backward_in_fp16(model, inputs, labels):
    with torch.autocast(inputs.device.type, dtype=torch.float16):
        loss = torch.nn.functional.cross_entropy(model(inputs), labels)
    (loss * 2).backward()
    for parameter in model.parameters():
        parameter.grad /= 2
""",
            "multiply the loss by a large scale",
        ),
        WrongAnswer(
            """def backward_in_fp16(model, inputs, labels):
    torch.nn.functional.cross_entropy(model(inputs), labels).backward()
""",
            "keep fp16 autocast",
        ),
    ),
    judge=_judge_scaling,
)


EXERCISES = (width_flops, loss_scaling)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
