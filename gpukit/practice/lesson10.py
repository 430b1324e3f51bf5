"""Lesson 10's exercises (what practitioners use): how much coarser FP8 rounds than bf16, and a checkpoint saved in
the background that holds the weights of the moment it was asked for."""

from __future__ import annotations

import copy
import shutil
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch
from torch import nn

from .. import fp8
from ..env import detect
from .exercise import Exercise, Mistake, Prediction, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "10_what_practitioners_use"
BEFORE = "## What to take away"


# --- 1 · predict: FP8's rounding against bf16's --------------------------------------------------------------------


def _measure_fp8_over_bf16() -> list[float]:
    # The relative error of casting real values (a Gaussian tensor, as activations roughly are) to e4m3 with a
    # per-tensor scale, and to bf16, measured here (gk.fp8.relative_error: the cast and back, ‖error‖ / ‖tensor‖).
    values = torch.randn(4096, 256, generator=torch.Generator().manual_seed(0))
    return [fp8.relative_error(values, "e4m3") / fp8.relative_error(values, "bf16")]


fp8_rounding = Prediction(
    key="10.fp8_rounding",
    kind="predict",
    title="how much coarser e4m3 rounds than bf16",
    prompt="""### Exercise 1 · Predict: FP8 against bf16

bf16 keeps 7 bits of mantissa, e4m3 3 (section 4), and a per-tensor scale keeps e4m3's values inside its range.
**Predict how many times larger e4m3's relative rounding error is than bf16's**, for the same tensor of real values
(Gaussian, like activations). The check casts such a tensor both ways here and measures both errors.""",
    starter="""rounding_prediction = ...  # e4m3's relative error ÷ bf16's, for the same values
""",
    answer="rounding_prediction",
    solution_code="""# Within the range, a format's relative rounding error is set by its mantissa: each bit fewer doubles it. bf16 has 7
# bits, e4m3 3: 2**(7 - 3) = 16 times coarser (the scale keeps the values in the range, away from subnormals).
rounding_prediction = 2 ** (7 - 3)
""",
    hints=(
        "the relative rounding error of a floating-point format is set by its mantissa bits",
        "one mantissa bit fewer doubles the spacing between neighbouring numbers, and the error with it",
        "2 ** (7 - 3)",
    ),
    wrong_answers=(
        WrongAnswer("rounding_prediction = 2 ** (7 - 2)", "e5m2"),
        WrongAnswer("rounding_prediction = 2 ** (7 - 3) / 2", "half the measured"),
    ),
    measure=_measure_fp8_over_bf16,
    what="the measured ratio",
    unit="x",
    floor=0.2,  # values near the bottom of e4m3's range round worse than the mantissa alone says
    mistakes=(
        Mistake(2.0, "twice the measured: that is e5m2 (2 mantissa bits), the gradients' format; e4m3 keeps 3"),
        Mistake(0.5, "half the measured: each mantissa bit fewer doubles the error: 7 - 3 = 4 bits, 2^4"),
    ),
)


# --- 2 · build it: a checkpoint saved in the background ------------------------------------------------------------


def _judge_background(save_in_background) -> Verdict:
    torch.manual_seed(0)
    model = nn.Linear(64, 64).to(detect().device)
    asked_for = copy.deepcopy({name: value.cpu() for name, value in model.state_dict().items()})
    caller, written, go_on = threading.get_ident(), [], threading.Event()
    real_save = torch.save

    def save_when_training_went_on(obj, file, *args, **kwargs):
        # A write in another thread waits until training has changed the weights (as the next optimizer step would),
        # so that a state handed over without a copy is caught every time, not only when the thread is slow.
        written.append(threading.get_ident() == caller)
        if not written[-1]:
            go_on.wait(timeout=30)
        return real_save(obj, file, *args, **kwargs)

    folder = Path(tempfile.mkdtemp(prefix="gpukit-practice-10-"))
    try:
        with mock.patch.object(torch, "save", save_when_training_went_on):
            started = time.perf_counter()
            handle = save_in_background(model.state_dict(), folder / "last.pt")
            blocked = time.perf_counter() - started
            with torch.no_grad():
                for parameter in model.parameters():
                    parameter.add_(1.0)  # the next step changes the weights in place
            go_on.set()
            if isinstance(handle, threading.Thread) and handle is not threading.current_thread():
                handle.join(timeout=60)
        saved = torch.load(folder / "last.pt") if (folder / "last.pt").exists() else None
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return _background_verdict(saved, asked_for, written, blocked)


def _background_verdict(saved, asked_for, written, blocked) -> Verdict:
    if saved is None:
        return Verdict(
            False,
            "no file at the path after the thread ended: save_in_background(state, path) must "
            "write the state to path (return the started thread, so that the check can join it)",
        )
    if written and all(written):
        return Verdict(
            False,
            f"the file was written before save_in_background returned ({blocked * 1e3:.3g} ms): "
            "training waited for the write; write in a thread, and return while it runs",
        )
    same = all(torch.equal(saved[name].cpu(), value) for name, value in asked_for.items())
    if not same:
        return Verdict(
            False,
            "the file holds the weights from after the save began: training changed them in place "
            "while the thread wrote them; copy the state (detach().clone(), on the CPU) before "
            "handing it to the thread",
        )
    return Verdict(
        True,
        f"training waited {blocked * 1e3:.3g} ms, the write ran in another thread, and the file holds "
        "the weights as they were when the save was asked for",
    )


background_save = Exercise(
    key="10.background_save",
    kind="build",
    title="a checkpoint saved in the background",
    prompt="""### Exercise 2 · Build it: save in the background

Write `save_in_background(state_dict, path)`: it must return at once, leaving a thread that writes the checkpoint to
`path` with `torch.save`, and it must return that thread (started). The file must hold the weights **as they were
when the save was asked for**, although training goes on and changes them in place meanwhile (section 3). The check
saves a model's state with it, changes the weights as the next step would, then reads the file.""",
    starter="""def save_in_background(state_dict, path):
    ...  # start a thread that torch.save-s the state as it is now to path, and return the thread
""",
    answer="save_in_background",
    solution_code="""import threading


def save_in_background(state_dict, path):
    # A snapshot first: the next optimizer step changes the weights in place, while the thread is still writing.
    snapshot = {name: value.detach().to("cpu", copy=True) for name, value in state_dict.items()}
    thread = threading.Thread(target=torch.save, args=(snapshot, path))
    thread.start()  # training goes on; the write runs beside it
    return thread
""",
    hints=(
        "threading.Thread(target=torch.save, args=(state, path)).start() writes in the background",
        "the thread may write after the next step has changed the weights in place: what must it write instead?",
        "a copy: {name: value.detach().to('cpu', copy=True) for name, value in state_dict.items()}",
    ),
    wrong_answers=(
        WrongAnswer(
            """import threading


def save_in_background(state_dict, path):
    thread = threading.Thread(target=torch.save, args=(state_dict, path))
    thread.start()
    return thread
""",
            "copy the state",
        ),
        WrongAnswer(
            """def save_in_background(state_dict, path):
    torch.save({name: value.detach().clone() for name, value in state_dict.items()}, path)
""",
            "training waited for the write",
        ),
    ),
    judge=_judge_background,
)


EXERCISES = (fp8_rounding, background_save)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
