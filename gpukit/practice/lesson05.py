"""Lesson 05's exercises (beyond one machine): a resume that continues a run bit for bit, and a checkpoint write
that a crash cannot damage."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch
from torch import nn

from .exercise import Exercise, Verdict, WrongAnswer
from .exercise import progress as _progress

LESSON = "05_beyond_one_machine"
BEFORE = "## Summary"


# --- 1 · fix it: a resume that continues exactly -----------------------------------------------------------------

RESUME_STEPS = 6  # the run; it stops after half of them and resumes


def _training_objects():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)
    return model, optimizer, scheduler


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 8, generator=generator), torch.randn(32, 1, generator=generator)) for _ in range(RESUME_STEPS)
    ]


def _train(objects, batches) -> None:
    model, optimizer, scheduler = objects
    for inputs, target in batches:
        nn.functional.mse_loss(model(inputs), target).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()


def _judge_resume(save, resume) -> Verdict:
    batches, half = _batches(), RESUME_STEPS // 2
    straight = _training_objects()
    _train(straight, batches)  # the run that never stopped
    folder = Path(tempfile.mkdtemp(prefix="gpukit-practice-05-"))
    try:
        first = _training_objects()
        _train(first, batches[:half])
        save(folder / "last.pt", *first)
        resumed = _training_objects()  # a new process: fresh objects, as built by the training script
        resume(folder / "last.pt", *resumed)
        restored = (len(resumed[1].state) > 0, resumed[2].last_epoch == half)
        _train(resumed, batches[half:])
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    difference = max((a - b).abs().max().item() for a, b in zip(straight[0].parameters(), resumed[0].parameters()))
    shown = f"after resuming, the parameters differ from the run that never stopped by {difference:.2g} (allowed 0)"
    if difference == 0:
        return Verdict(True, shown + ": bit for bit")
    if not restored[0]:
        return Verdict(
            False,
            f"{shown}: the optimizer's momentum restarted from zero: save optimizer.state_dict() "
            "and load it into the new optimizer",
        )
    if not restored[1]:
        return Verdict(
            False,
            f"{shown}: the learning-rate schedule restarted (at step {resumed[2].last_epoch - half}"
            f", not {half}): save scheduler.state_dict() and load it",
        )
    return Verdict(False, f"{shown}: model, optimizer and schedule must all continue from where they stopped")


class _ResumeExercise(Exercise):
    """The answer is two functions, save and resume: the check cell passes them as a tuple."""

    def judge_answer(self, answer) -> Verdict:
        return _judge_resume(*answer)


resume_exactly = _ResumeExercise(
    key="05.resume_exactly",
    kind="fix",
    title="a resume that continues a run bit for bit",
    prompt=f"""### Exercise 1 · Fix it: resume where the run stopped

A training script calls `save(path, model, optimizer, scheduler)` after every epoch, and at start-up, when a
checkpoint exists, `resume(path, model, optimizer, scheduler)` on the objects it has just built. As shipped, a
resumed run does not continue the run that stopped: **change `save` and `resume` so that it does, bit for bit**
(section 3 lists what must be kept). The check trains a small network {RESUME_STEPS} steps (SGD with momentum, a step
schedule) without stopping, and again stopping after {RESUME_STEPS // 2} with your functions, and compares the
parameters.""",
    starter="""def save(path, model, optimizer, scheduler):
    torch.save({"model": model.state_dict()}, path)


def resume(path, model, optimizer, scheduler):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])


checkpoint_functions = save, resume
""",
    answer="checkpoint_functions",
    solution_code="""def save(path, model, optimizer, scheduler):
    # Everything the next step depends on: the weights, the momentum buffers, where the schedule is.
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, path)


def resume(path, model, optimizer, scheduler):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])


checkpoint_functions = save, resume
""",
    hints=(
        "what, besides the weights, decides the next optimizer step?",
        "SGD with momentum keeps a buffer per parameter, and the schedule knows which step it is at",
        "save and load optimizer.state_dict() and scheduler.state_dict() beside model.state_dict()",
    ),
    wrong_answers=(
        WrongAnswer(
            """def save(path, model, optimizer, scheduler):
    torch.save({"model": model.state_dict(), "scheduler": scheduler.state_dict()}, path)


def resume(path, model, optimizer, scheduler):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    scheduler.load_state_dict(checkpoint["scheduler"])


checkpoint_functions = save, resume
""",
            "the optimizer's momentum restarted from zero",
        ),
        WrongAnswer(
            """def save(path, model, optimizer, scheduler):
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, path)


def resume(path, model, optimizer, scheduler):
    checkpoint = torch.load(path)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])


checkpoint_functions = save, resume
""",
            "the learning-rate schedule restarted",
        ),
    ),
)


# --- 2 · build it: a checkpoint write that a crash cannot damage ---------------------------------------------------


class _PowerCut:
    """Pickling this raises, as a crash would stop a write half-way: torch.save has already opened the file."""

    def __reduce__(self):
        raise RuntimeError("the power went out in the middle of the save")


def _judge_atomic(save_atomic) -> Verdict:
    folder = Path(tempfile.mkdtemp(prefix="gpukit-practice-05-"))
    path = folder / "last.pt"
    before = {"weights": torch.arange(1000.0), "epoch": 1}
    try:
        save_atomic(before, path)
        if not path.exists() or not torch.equal(torch.load(path)["weights"], before["weights"]):
            return Verdict(False, "save_atomic(state, path) did not leave `state` at `path`, readable by torch.load")
        try:
            save_atomic({"weights": torch.arange(2000.0), "epoch": 2, "crash": _PowerCut()}, path)
        except RuntimeError:
            pass  # the crash; what matters is what it left behind
        if not path.exists():
            return Verdict(
                False,
                "after a crash in the middle of a save, there is no file at the path: the previous "
                "checkpoint is gone; write the new one elsewhere first, then replace",
            )
        try:
            after = torch.load(path)
        except Exception as error:  # any way the file is unreadable: torch.load's errors differ by damage
            return Verdict(
                False,
                f"after a crash in the middle of a save, torch.load fails ({type(error).__name__}): "
                "the previous checkpoint was damaged; write to a temporary file in the same folder, "
                "then os.replace it over the path",
            )
        leftovers = sorted(item.name for item in folder.iterdir() if item.name != "last.pt")
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    if after.get("epoch") != 1 or not torch.equal(after["weights"], before["weights"]):
        return Verdict(False, "after a crash the file holds something other than the previous checkpoint")
    kept = f"; left beside it: {', '.join(leftovers)}" if leftovers else ""
    return Verdict(True, f"a crash half-way through a save left the previous checkpoint whole{kept}")


atomic_save = Exercise(
    key="05.atomic_save",
    kind="build",
    title="a checkpoint write a crash cannot damage",
    prompt="""### Exercise 2 · Build it: an atomic save

Write `save_atomic(state, path)`: like `torch.save(state, path)`, except that a crash in the middle of it must leave
the previous file at `path` intact (section 3, "Checkpoints written atomically"). The check saves a checkpoint with
it, then saves another whose pickling fails half-way, as a crash would stop it, and loads what is left at `path`.""",
    starter="""def save_atomic(state, path):
    ...  # torch.save(state, path), but a crash half-way leaves the previous file at path intact
""",
    answer="save_atomic",
    solution_code="""import os
from pathlib import Path


def save_atomic(state, path):
    path = Path(path)
    temporary = path.with_name(path.name + ".tmp")  # the same folder, so the same file system: rename is atomic
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())  # on disk before the rename, so a power cut cannot leave an empty file
        os.replace(temporary, path)  # atomic: readers see the old file or the new one, never half of one
    finally:
        temporary.unlink(missing_ok=True)  # after a crash, no half-written file is left behind
""",
    hints=(
        "torch.save(state, path) truncates the file first: a crash after that leaves a broken file. Where else could "
        "the new file be written first?",
        "write to a temporary file beside it, then rename it over the path: a rename replaces a file in one step",
        "torch.save into path + '.tmp', then os.replace(temporary, path)",
    ),
    wrong_answers=(
        WrongAnswer(
            """def save_atomic(state, path):
    torch.save(state, path)
""",
            "the previous checkpoint was damaged",
        ),
        WrongAnswer(
            """import os


def save_atomic(state, path):
    if os.path.exists(path):
        os.remove(path)  # make room for the new file
    torch.save(state, path)
""",
            "the previous checkpoint was damaged",
        ),
    ),
    judge=_judge_atomic,
)


EXERCISES = (resume_exactly, atomic_save)


def progress() -> None:
    """This lesson's exercises and what their last check said in this kernel."""
    _progress(EXERCISES)
