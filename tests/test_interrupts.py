"""Ctrl-C in a notebook (issue "Never lose or corrupt a run"): a KeyboardInterrupt raised at many points of a fit
(loading data, forward, mid-backward, between backward and the optimizer step, inside it, the schedule, a save
before, during and after its write, evaluation, the History's row, the progress bar, the very end) propagates with a
note saying how far fit got and which save last.pt holds; the model keeps no gradient and finite weights; and the
same call again (with a fresh model, or the very objects the interrupted call used, as a re-run cell has) ends
bit-equal to a run never interrupted: weights, optimizer state and History rows.

In-process on the CPU: each point is a counter at a place the loop passes through, raising at its n-th call."""

import os
import signal
from collections import Counter
from contextlib import nullcontext

import pytest
import torch
from torch import nn
from torch.optim.lr_scheduler import OneCycleLR
from torch.utils.data import Dataset

import gpukit as gk
from gpukit.preemption import Preempted, sigterm_raises
from gpukit.train import checkpoint, checkpoint_file, loop
from gpukit.train.checkpoint import read_checkpoint
from gpukit.widgets import Progress
from tests.helpers import tiny_gpt
from tests.test_resume import assert_equal, disturb_generators

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons of tiny runs; no timing


class Trap:
    """Counts the calls of each place fit passes through; raises KeyboardInterrupt at the n-th call of one."""

    def __init__(self):
        self.calls, self.armed, self.sigterm = Counter(), None, False  # armed: (place, n) or None

    def arm(self, place: str, n: int, sigterm: bool = False) -> None:
        """`sigterm`: send this process SIGTERM there (a scheduler preempting the job) instead of raising."""
        self.calls, self.armed, self.sigterm = Counter(), (place, n), sigterm

    def hit(self, place: str) -> None:
        self.calls[place] += 1
        if self.armed == (place, self.calls[place]):
            self.armed = None  # once: a handler that runs the place again (a save in a finally) is not stopped
            if self.sigterm:  # its handler runs before this returns: it raises (Preempted) or asks fit to stop
                signal.raise_signal(signal.SIGTERM)
                return
            raise KeyboardInterrupt


TRAP = Trap()


class CountedImages(Dataset):
    """48 seeded 3×8×8 images in 4 classes; every item read is a "data" call."""

    def __init__(self, size: int = 48, seed: int = 3):
        generator = torch.Generator().manual_seed(seed)
        self.images, self.labels = torch.randn(size, 3, 8, 8, generator=generator), torch.arange(size) % 4

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        TRAP.hit("data")
        return self.images[index], self.labels[index]


def watched(model: nn.Module) -> nn.Module:
    """Forward calls counted as "forward" in training and "eval forward" in eval mode; the gradient of the first
    parameter (computed last in backward) as "backward"."""
    model.register_forward_pre_hook(lambda module, _: TRAP.hit("forward" if module.training else "eval forward"))
    first = next(model.parameters())
    first.register_hook(lambda grad: TRAP.hit("backward"))
    return model


def cnn() -> nn.Module:  # with BatchNorm and dropout
    torch.manual_seed(1)
    return watched(
        nn.Sequential(
            nn.Conv2d(3, 8, 3),
            nn.BatchNorm2d(8),
            nn.ReLU(),
            nn.Dropout(0.3),
            nn.Flatten(),
            nn.Linear(8 * 6 * 6, 4),
        )
    )


def gpt() -> nn.Module:
    return watched(tiny_gpt(dropout=0.2, max_seq_len=16))


def text_data():
    text = "".join(f"step {i} of the run, loss {i % 7}.\n" for i in range(30)).encode()[: 48 * 16 + 1]
    return gk.data.TokenDataset(torch.tensor(list(text), dtype=torch.uint8), seq_len=16)  # 48 windows


def optimizer(parameters):
    """SGD with Nesterov momentum whose step counts "step" before and "stepped" after the update."""
    built = torch.optim.SGD(parameters, lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)
    built.register_step_pre_hook(lambda *_: TRAP.hit("step"))
    built.register_step_post_hook(lambda *_: TRAP.hit("stepped"))
    return built


KINDS = {
    # 48 samples at micro-batch 8, accumulate=2: 3 optimizer steps per epoch, 6 in all; a save at steps 2, 3 (the
    # epoch's end), 4 and 6 (the end); two evaluation batches after each epoch.
    "cnn": (cnn, CountedImages, lambda: [(torch.randn(8, 3, 8, 8), torch.arange(8) % 4) for _ in "ab"], {}),
    "gpt": (
        gpt,
        text_data,
        lambda: [(window[:, :-1], window[:, 1:]) for window in torch.randint(0, 256, (2, 8, 17))],
        {"loss_fn": gk.step.cross_entropy, "lr": 3e-3},
    ),
}
OPTIONS = dict(
    epochs=2, batch_size=8, accumulate=2, save_every=2, log_every=1, progress=False, device="cpu", optimizer=optimizer
)


def fit(kind: str, model, data, directory):
    make_model, make_data, make_eval, options = KINDS[kind]
    torch.manual_seed(7)  # the eval data's draws
    return gk.fit(model, data, eval_data=make_eval(), checkpoint_dir=directory, **OPTIONS, **options)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """Each kind's run never interrupted: (model, History, last.pt's state)."""
    runs = {}
    for kind, (make_model, make_data, _, _) in KINDS.items():
        directory = tmp_path_factory.mktemp(f"straight-{kind}")
        TRAP.arm("nowhere", 0)
        model = make_model()
        disturb_generators(100)
        history = fit(kind, model, make_data(), directory)
        runs[kind] = (model, history, read_checkpoint(directory / "last.pt"))
    return runs


# (kind, place, n): the n-th call of place raises; "before"/"after" a wrapped function runs.
POINTS = {
    "loading the first sample": ("cnn", "data", 1),
    "the first forward": ("cnn", "forward", 1),
    "mid-accumulation (step 1's second forward)": ("cnn", "forward", 2),
    "mid-backward (step 2's first micro-batch)": ("cnn", "backward", 3),
    "between backward and optimizer step 3": ("cnn", "step", 3),
    "after optimizer step 2's update": ("cnn", "stepped", 2),
    "the schedule's step after optimizer step 3": ("cnn", "schedule", 4),
    "before the first save is written": ("cnn", "save before", 1),
    "in the middle of a save's write": ("cnn", "save write", 3),
    "after epoch 1's save is written": ("cnn", "save after", 2),
    "after a save, before the epoch ends": ("cnn", "forward", 5),
    "evaluation after epoch 1": ("cnn", "eval forward", 2),
    "logging step 3's History row": ("cnn", "log", 3),
    "showing epoch 2's row": ("cnn", "epoch shown", 2),
    "before the last save": ("cnn", "save before", 4),
    "after the last save": ("cnn", "save after", 4),
    "closing the progress bar, at the very end": ("cnn", "close", 1),
    "gpt: mid-accumulation": ("gpt", "forward", 4),
    "gpt: between backward and step": ("gpt", "step", 2),
    "gpt: evaluation after epoch 2": ("gpt", "eval forward", 4),
    "gpt: after the last save": ("gpt", "save after", 4),
}
SAME_OBJECTS = {  # points also resumed with the interrupted call's own model and data objects; before the first save
    # fit puts the model and optimizer back as it found them (nothing on disk to resume from), after it the save resumes
    "the first forward",
    "mid-accumulation (step 1's second forward)",
    "after optimizer step 2's update",
    "before the first save is written",
    "the schedule's step after optimizer step 3",
    "after epoch 1's save is written",
    "after a save, before the epoch ends",
    "evaluation after epoch 1",
    "gpt: mid-accumulation",
    "gpt: between backward and step",
    "gpt: evaluation after epoch 2",
}


def counted(place: str, function, when: str = "before"):
    def wrapper(*args, **kwargs):
        if when == "before":
            TRAP.hit(place)
        result = function(*args, **kwargs)
        if when == "after":
            TRAP.hit(place)
        return result

    return wrapper


@pytest.fixture(autouse=True)
def places(monkeypatch):
    """The places that are functions of gpukit's, wrapped to count their calls."""
    write = checkpoint.write_checkpoint
    monkeypatch.setattr(checkpoint, "write_checkpoint", counted("save before", counted("save after", write, "after")))
    monkeypatch.setattr(checkpoint_file._Hashing, "write", counted("save write", checkpoint_file._Hashing.write))
    monkeypatch.setattr(loop, "write_row", counted("log", loop.write_row))
    monkeypatch.setattr(Progress, "epoch_done", counted("epoch shown", Progress.epoch_done))
    monkeypatch.setattr(Progress, "close", counted("close", Progress.close, "after"))
    # (OneCycleLR steps once as it is built: its n-th call is the schedule's step after optimizer step n - 1)
    monkeypatch.setattr(OneCycleLR, "step", counted("schedule", OneCycleLR.step))
    yield
    TRAP.arm("nowhere", 0)


def assert_same_run(resumed: nn.Module, history: gk.History, directory, straight) -> None:
    model, straight_history, saved = straight
    for name, value in model.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert_equal(saved["optimizer"], read_checkpoint(directory / "last.pt")["optimizer"], "optimizer")
    measured = ("step", "epoch", "loss", "lr")
    assert [[row[k] for k in measured] for row in history.steps] == [
        [row[k] for k in measured] for row in straight_history.steps
    ]
    timing = ("seconds", "peak_memory")
    assert [{k: v for k, v in row.items() if k not in timing} for row in history.epochs] == [
        {k: v for k, v in row.items() if k not in timing} for row in straight_history.epochs
    ]


def assert_says_how_far(note: str, directory, place: str) -> None:
    """The note names the optimizer steps the weights hold and the save that last.pt holds (read from the file)."""
    if place in ("step", "stepped"):  # inside optimizer.step: its update may be in the weights, in part or whole
        assert f"during optimizer step {TRAP.calls['step']} of 6" in note, note
    else:
        assert f"after optimizer step {TRAP.calls['stepped']} of 6" in note, note  # the updates the weights hold
    if (directory / "last.pt").exists():
        saved = read_checkpoint(directory / "last.pt")
        epoch = saved["epoch"] + (saved["position"] > 0)
        assert f"keeps the last good save: optimizer step {saved['step']} (epoch {epoch})" in note, note
    else:
        assert "nothing was saved there yet" in note and "put back as fit found them" in note, note


@pytest.mark.parametrize("point", POINTS)
def test_an_interrupted_fit_resumes_bit_equal(point, uninterrupted, tmp_path):
    kind, place, n = POINTS[point]
    make_model, make_data, _, _ = KINDS[kind]
    model, data = make_model(), make_data()
    disturb_generators(100)
    TRAP.arm(place, n)
    with pytest.raises(KeyboardInterrupt) as stopped:
        fit(kind, model, data, tmp_path)
    assert TRAP.armed is None, f"{place} was called {TRAP.calls[place]} times, never the {n}th"
    assert type(stopped.value) is KeyboardInterrupt
    assert_says_how_far("".join(getattr(stopped.value, "__notes__", [])), tmp_path, place)
    assert all(parameter.grad is None for parameter in model.parameters())
    assert all(parameter.isfinite().all() for parameter in model.parameters())
    again = [(make_model(), make_data())] + [(model, data)] * (point in SAME_OBJECTS)
    for number, (resumed, resumed_data) in enumerate(again):
        directory = tmp_path if number == len(again) - 1 else tmp_path.with_name(tmp_path.name + "-copy")
        if directory != tmp_path:  # the fresh model resumes a copy, so that the same objects resume the original
            directory.mkdir()
            if (tmp_path / "last.pt").exists():
                (directory / "last.pt").write_bytes((tmp_path / "last.pt").read_bytes())
        disturb_generators(101 + number)
        history = fit(kind, resumed, resumed_data, directory)
        assert_same_run(resumed, history, directory, uninterrupted[kind])


def test_an_interrupt_during_the_checks_before_training_says_so(tmp_path):
    """Ctrl-C while fit runs eval_data's first batch through the model, before the first step: a note says training
    had not started; the weights are as they came and nothing was saved."""
    model = cnn()
    before = {name: value.clone() for name, value in model.state_dict().items()}
    TRAP.arm("eval forward", 1)  # the first eval forward is fit's check of eval_data, before any training
    with pytest.raises(KeyboardInterrupt) as stopped:
        fit("cnn", model, CountedImages(), tmp_path)
    assert TRAP.calls["forward"] == 0  # no training forward ran
    note = "".join(getattr(stopped.value, "__notes__", []))
    assert "interrupted before training started" in note and "nothing was saved" in note, note
    assert all(torch.equal(before[name], value) for name, value in model.state_dict().items())
    assert not (tmp_path / "last.pt").exists()


SIGTERM_POINTS = {  # point: the optimizer step after which the run is saved and stops
    "mid-backward (step 2's first micro-batch)": 2,
    "in the middle of a save's write": 3,  # (the save at step 2 goes on; step 3 is the next one)
    "evaluation after epoch 1": 3,  # epoch 1's save, at its end
    "gpt: mid-accumulation": 2,
    "gpt: evaluation after epoch 2": 6,  # the last save: the run had ended
}


@pytest.mark.parametrize("handler", ["default", "sigterm_raises"])
@pytest.mark.parametrize("point", SIGTERM_POINTS)
def test_a_sigterm_saves_after_the_step_then_stops_fit_and_the_save_resumes_bit_equal(
    point, handler, uninterrupted, tmp_path
):
    """SIGTERM, how Slurm and Kubernetes preempt and torchrun and launch stop their workers: fit ends the optimizer step
    in progress, saves there, and raises Preempted, whose note says which save resumes; the same call resumes from it
    to a run never stopped. In a plain process (the default handler) SIGTERM ended it at once, with no word and the
    work since the last save lost; under gk.preemption.sigterm_raises (`gpukit train`, launch's workers) it stopped at
    once, keeping only the last save."""
    kind, place, n = POINTS[point]
    make_model, make_data, _, _ = KINDS[kind]
    model, before = make_model(), signal.getsignal(signal.SIGTERM)
    disturb_generators(100)
    TRAP.arm(place, n, sigterm=True)
    with pytest.raises(Preempted) as stopped, sigterm_raises() if handler == "sigterm_raises" else nullcontext():
        fit(kind, model, make_data(), tmp_path)
    assert TRAP.armed is None and str(stopped.value) == "stopped by SIGTERM at the next safe point, after saving"
    assert signal.getsignal(signal.SIGTERM) == before  # put back as it was
    saved = read_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == TRAP.calls["stepped"] == SIGTERM_POINTS[point]  # saved at the step it stopped after
    assert_says_how_far("".join(getattr(stopped.value, "__notes__", [])), tmp_path, place)
    assert all(parameter.grad is None for parameter in model.parameters())
    resumed = make_model()
    disturb_generators(101)
    history = fit(kind, resumed, make_data(), tmp_path)
    assert_same_run(resumed, history, tmp_path, uninterrupted[kind])


def test_a_sigterm_without_a_checkpoint_dir_stops_after_the_step_and_says_nothing_was_saved():
    TRAP.arm("forward", 3, sigterm=True)  # step 2's first micro-batch
    with pytest.raises(Preempted) as stopped:
        gk.fit(cnn(), CountedImages(), **(OPTIONS | {"save_every": None}))
    note = "".join(getattr(stopped.value, "__notes__", []))
    assert "after optimizer step 2 of 6" in note and "no checkpoint_dir, nothing saved" in note, note
    assert TRAP.calls["stepped"] == 2


def test_a_loop_that_saves_before_it_stops_hears_the_first_sigterm_as_a_request():
    """sigterm_requests_a_stop, for a loop that finishes its step and saves first: the first SIGTERM only asks, a
    second stops at once, and SIGTERM's handler is put back after; a SIGTERM ignored on purpose stays ignored."""
    before = signal.getsignal(signal.SIGTERM)
    with gk.preemption.sigterm_requests_a_stop() as request:
        assert not request.asked
        signal.raise_signal(signal.SIGTERM)  # (its handler runs before this returns)
        assert request.asked
        with pytest.raises(Preempted, match="second SIGTERM"):
            signal.raise_signal(signal.SIGTERM)
        assert isinstance(request.preempted(), KeyboardInterrupt)  # what handles Ctrl-C handles it
    with gk.preemption.sigterm_requests_a_stop() as request:
        signal.raise_signal(signal.SIGTERM)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(gk.preemption, "_parent_gone", True)  # end_with_parent's thread repeats the kernel's SIGTERM
            signal.raise_signal(signal.SIGTERM)  # the same news, not a second request: no Preempted
        assert request.asked
    with gk.preemption.sigterm_requests_a_stop() as request:
        signal.raise_signal(signal.SIGTERM)
        with pytest.MonkeyPatch.context() as patch:  # the parent watched has died, its thread not yet noticed it
            patch.setattr(gk.preemption, "_parent", os.getppid() + 10**7)
            patch.setattr(gk.preemption, "_watcher", os.getpid())
            signal.raise_signal(signal.SIGTERM)  # news of that death (the kernel's and a repeat): no Preempted
        assert request.asked
    assert signal.getsignal(signal.SIGTERM) == before
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        with sigterm_raises(), gk.preemption.sigterm_requests_a_stop() as request:
            signal.raise_signal(signal.SIGTERM)  # ignored: neither raises nor asks
        assert not request.asked and signal.getsignal(signal.SIGTERM) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
