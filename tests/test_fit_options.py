"""fit's option groups (gk.ModelTransforms, gk.Saving, gk.Reporting) and the flat keywords from before them (issue 46).

Every keyword fit took before the groups still works and gives the same run, to the bit, as its new spelling, and
reaches fit as the same group; a folder where a Saving is expected becomes one, in one place; each group checks
itself when it is made, before any work; fit's signature and docstring keep their budget, and evaluate documents every
argument. A run saved by the code before the change (commit 416259d) resumes today, bit-exact, and today's fit
trains as that code did.
"""

import dataclasses
import inspect
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit import fp8
from gpukit.train import loop
from gpukit.train.options import OLD_KEYWORDS, RENAMED, as_group
from tests.helpers import tiny_gpt, tokens

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons of tiny runs; no timing

# Columns that measure time or energy: they differ between two runs of the same computation.
TIMED = {
    "seconds",
    "step_time",
    "samples_per_second",
    "tokens_per_second",
    "peak_memory",
    "energy_j",
    "joules_per_sample",
    "co2_grams",
    "mean_power_w",
    "mean_utilization",
    "throttle_reasons",
}


def small_cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(), nn.Linear(8 * 6 * 6, 4)
    )


def mlp16() -> nn.Module:
    """Linear layers whose dimensions are multiples of 16, as FP8 needs."""
    torch.manual_seed(2)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 16))


def image_batches() -> list:
    generator = torch.Generator().manual_seed(3)
    return [(torch.randn(8, 3, 8, 8, generator=generator), torch.randint(0, 4, (8,), generator=generator))] * 4


def vector_batches() -> list:
    generator = torch.Generator().manual_seed(4)
    return [(torch.randn(8, 16, generator=generator), torch.randint(0, 16, (8,), generator=generator))] * 4


def token_batches() -> list:
    return [(tokens(4, 16, seed=5), tokens(4, 16, seed=6))] * 3


def emulated_fp8():
    from torchao.float8 import Float8LinearConfig

    return Float8LinearConfig(emulate=True)


T, S, R = gk.ModelTransforms, gk.Saving, gk.Reporting
# name: (model, data, the old keywords, the new spelling); a callable value is made afresh for each run,
# a "{folder}" in a value is a fresh folder for each run.
CASES = {
    "channels_last": (small_cnn, image_batches, {"channels_last": True}, {"transforms": T(channels_last=True)}),
    "compile": (
        mlp16,
        vector_batches,
        {"compile": {"backend": "eager"}},
        {"transforms": T(compile={"backend": "eager"})},
    ),
    "activation_checkpointing": (
        lambda: tiny_gpt(dropout=0.1),
        token_batches,
        {"activation_checkpointing": "full"},
        {"transforms": T(activation_checkpointing="full")},
    ),
    "offload_activations": (
        tiny_gpt,
        token_batches,
        {"offload_activations": True},
        {"transforms": T(offload_activations=True)},
    ),
    "fp8": (mlp16, vector_batches, {"fp8": emulated_fp8}, {"transforms": lambda: T(fp8=emulated_fp8())}),
    "checkpoint_dir": (small_cnn, image_batches, {"checkpoint_dir": "{folder}"}, {"saving": "{folder}"}),
    "checkpoint_dir as a Saving": (small_cnn, image_batches, {"checkpoint_dir": "{folder}"}, {"saving": S("{folder}")}),
    "save_every": (
        small_cnn,
        image_batches,
        {"checkpoint_dir": "{folder}", "save_every": 2},
        {"saving": S("{folder}", every=2)},
    ),
    "save_in_background": (
        small_cnn,
        image_batches,
        {"checkpoint_dir": "{folder}", "save_in_background": True},
        {"saving": S("{folder}", in_background=True)},
    ),
    "live_plot": (small_cnn, image_batches, {"live_plot": True}, {"reporting": R(live_plot=True)}),
    "log_dir": (small_cnn, image_batches, {"log_dir": "{folder}"}, {"reporting": R(log_dir="{folder}")}),
    "monitor": (small_cnn, image_batches, {"monitor": True}, {"reporting": R(monitor=True)}),
}


def made(value, folder):
    """A case's value for one run: called if a maker, its "{folder}" (inside a group too) the run's own folder."""
    value = value() if callable(value) and not isinstance(value, type) else value
    if value == "{folder}":
        return str(folder)
    if dataclasses.is_dataclass(value):
        return dataclasses.replace(
            value,
            **{
                f.name: made(getattr(value, f.name), folder)
                for f in dataclasses.fields(value)
                if getattr(value, f.name) == "{folder}"
            },
        )
    return value


def run(make_model, make_data, options: dict, folder, monkeypatch):
    """(History, the trained model's state, the groups fit's setup received, the warnings said) of one fit."""
    received = {}

    def start_run(**arguments):
        received.update({name: arguments[name] for name in ("transforms", "saving", "reporting")})
        return setup_start_run(**arguments)

    setup_start_run = loop.start_run
    monkeypatch.setattr(loop, "start_run", start_run)
    model = make_model()
    options = {name: made(value, folder) for name, value in options.items()}
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        history = gk.fit(model, make_data(), lr=0.05, log_every=1, progress=False, device="cpu", **options)
    monkeypatch.setattr(loop, "start_run", setup_start_run)
    # The warnings fit said to its caller (not torch's own, some of which it says once a process).
    return history, model.state_dict(), received, sorted(str(w.message) for w in said if w.filename == __file__)


def untimed(rows: list[dict]) -> list[dict]:
    return [{name: value for name, value in row.items() if name not in TIMED} for row in rows]


def folders_left_out(group):
    """A group compared without its folders (each run has its own)."""
    return {name: value for name, value in dataclasses.asdict(group).items() if name not in ("folder", "log_dir")}


@pytest.mark.parametrize("case", CASES)
def test_each_old_keyword_gives_the_run_of_its_new_spelling_to_the_bit(case, tmp_path, monkeypatch):
    make_model, make_data, old, new = CASES[case]
    if case == "fp8" and not fp8.torchao_available():
        pytest.skip("torchao is not installed (pip install 'gpukit[fp8]'): fp8 cannot run here")
    old_run = run(make_model, make_data, old, tmp_path / "old", monkeypatch)
    new_run = run(make_model, make_data, new, tmp_path / "new", monkeypatch)
    (old_history, old_state, old_groups, old_said), (new_history, new_state, new_groups, new_said) = old_run, new_run
    assert untimed(old_history.steps) == untimed(new_history.steps) and old_history.steps
    assert untimed(old_history.epochs) == untimed(new_history.epochs)
    assert old_state.keys() == new_state.keys() and all(torch.equal(old_state[k], new_state[k]) for k in old_state)
    assert old_said == new_said
    # The keyword reached fit as its group: the same group both ways, and not the group that is off.
    for name in ("transforms", "saving", "reporting"):
        assert folders_left_out(old_groups[name]) == folders_left_out(new_groups[name]), name
    for keyword in old:
        group, field = OLD_KEYWORDS[keyword]
        assert old_groups[group] != as_group(group, None) and getattr(old_groups[group], field) not in (None, False)


def test_the_option_groups_do_what_they_say(tmp_path, monkeypatch):
    """Each case's new spelling has the effect its keyword had: the saves, the logs, the layout, the FP8 numbers."""
    _, state, _, _ = run(small_cnn, image_batches, {"transforms": T(channels_last=True)}, tmp_path, monkeypatch)
    assert state["0.weight"].is_contiguous(memory_format=torch.channels_last)
    run(small_cnn, image_batches, {"saving": S(tmp_path / "saved", every=2)}, tmp_path, monkeypatch)
    assert (tmp_path / "saved" / "last.pt").is_file()
    run(small_cnn, image_batches, {"reporting": R(log_dir=tmp_path / "logs")}, tmp_path, monkeypatch)
    assert any(path.name.startswith("events.out.tfevents") for path in (tmp_path / "logs").iterdir())
    _, _, _, said = run(tiny_gpt, token_batches, {"transforms": T(offload_activations=True)}, tmp_path, monkeypatch)
    assert any("nothing is offloaded" in message for message in said), said


def test_a_folder_is_a_saving_and_none_is_a_group_that_is_off(tmp_path):
    assert as_group("saving", tmp_path) == gk.Saving(tmp_path) and as_group("saving", "runs/a") == gk.Saving("runs/a")
    assert as_group("transforms", None) == gk.ModelTransforms() and as_group("reporting", None) == gk.Reporting()
    made_ = gk.Reporting(monitor=True)
    assert as_group("reporting", made_) is made_
    with pytest.raises(TypeError, match=r"transforms must be a gk.ModelTransforms or None, got 'compile'"):
        as_group("transforms", "compile")
    with pytest.raises(TypeError, match=r"saving must be a gk.Saving or a folder path or None"):
        as_group("saving", 3)


class Untouchable:
    """Training data whose use fails the test: fit must refuse before it reads any."""

    def __iter__(self):
        raise AssertionError("fit read the data before refusing")

    def __len__(self):
        raise AssertionError("fit read the data before refusing")


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"compile": True, "transforms": T()}, TypeError, r"compile and transforms= name the same options"),
        ({"save_every": 2, "saving": "runs/a"}, TypeError, r"save_every and saving= name the same options"),
        ({"transforms": T}, TypeError, r"transforms must be a gk.ModelTransforms"),
        ({"compile": "fast"}, ValueError, r"compile='fast' is unknown"),
        ({"activation_checkpointing": "some"}, ValueError, r"activation checkpointing policy 'some' is unknown"),
        ({"offload_activations": "yes"}, TypeError, r"offload_activations must be True or False"),
        (
            {"save_every": 2},
            ValueError,
            r"save_every=2 saves into checkpoint_dir: pass checkpoint_dir too \(.*gk.Saving\(folder, every=2\)",
        ),
        ({"checkpoint_dir": "runs/a", "save_every": 0}, ValueError, r"save_every must be a positive integer"),
        ({"save_in_background": True}, ValueError, r"save_in_background=True .*checkpoint_dir"),
        ({"save_in_background": "yes", "checkpoint_dir": "a"}, TypeError, r"save_in_background .*True or False"),
        ({"log_dir": 3}, TypeError, r"log_dir must be a folder path"),
        ({"monitor": "yes"}, TypeError, r"monitor must be True, False or a gk.hardware.Monitor"),
    ],
)
def test_a_wrong_option_is_refused_before_any_work_naming_it(options, error, words, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # (a folder a refused call might create would land here)
    with pytest.raises(error, match=words):
        gk.fit(nn.Linear(2, 2), Untouchable(), device="cpu", **options)
    assert not any(tmp_path.iterdir())


def test_each_group_checks_itself_when_made():
    with pytest.raises(ValueError, match="compile='fast' is unknown"):
        gk.ModelTransforms(compile="fast")
    with pytest.raises(ValueError, match=r"save_every=3 saves into checkpoint_dir"):
        gk.Saving(every=3)
    with pytest.raises(TypeError, match="log_dir must be a folder path"):
        gk.Reporting(log_dir=["runs"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        gk.Saving("runs/a").every = 0  # made once, checked once: it cannot be changed past its check


def docstring_arguments(function) -> list[str]:
    """The names each paragraph of a docstring opens with ("epochs, max_steps: ..." gives both), in order."""
    names = []
    for line in inspect.getdoc(function).splitlines():
        match = re.match(r"^([a-z_0-9]+(?:, [a-z_0-9]+)*):", line)
        if match:
            names += match.group(1).split(", ")
    return names


def test_fit_keeps_24_parameters_under_headings_and_a_docstring_on_one_screen_that_follows_them():
    parameters = list(inspect.signature(gk.fit).parameters)
    assert parameters[:2] == ["model", "train_data"] and len(parameters) <= 24, parameters
    options = parameters[2:]
    source = inspect.getsource(inspect.unwrap(gk.fit))
    headings = re.findall(
        r"^    # (How much|How it learns|What is measured|Where and how reproducibly|What you see)",
        source,
        flags=re.MULTILINE,
    )
    assert len(headings) == 5, headings
    assert len(inspect.getdoc(gk.fit).splitlines()) <= 42
    documented = docstring_arguments(gk.fit)
    assert documented == ["train_data", *options], documented  # every argument, in the signature's order
    old = (set(OLD_KEYWORDS) | set(RENAMED)) - set(options)
    assert all(name in inspect.getdoc(gk.fit) for name in old)  # the old keywords are said to still work


def test_evaluate_documents_every_argument():
    documented = set(docstring_arguments(gk.evaluate))
    missing = set(inspect.signature(gk.evaluate).parameters) - {"model", "data"} - documented
    assert not missing, missing


def test_each_option_group_documents_every_field():
    for group in (gk.ModelTransforms, gk.Saving, gk.Reporting):
        documented = set(docstring_arguments(group))
        missing = {field.name for field in dataclasses.fields(group)} - documented
        assert not missing, (group.__name__, missing)


# ---------------------------------------------------------------------------------------------
# The code before the groups (commit 416259d): its checkpoint resumes today, and its run is today's, to the bit

OLD_COMMIT = "416259d"  # the last commit before fit's options were grouped and train/loop.py was carved
ROOT = Path(__file__).resolve().parents[1]
OPTIONS = dict(epochs=2, batch_size=16, log_every=2, progress=False, device="cpu", optimizer="adamw", lr=3e-3)


def dropout_cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Dropout(0.3),
        nn.Flatten(),
        nn.Linear(8 * 3 * 3, 4),
    )


def shuffled_images():  # 96 images: 6 optimizer steps an epoch at batch 16, in an order fit draws
    generator = torch.Generator().manual_seed(3)
    return torch.utils.data.TensorDataset(torch.randn(96, 3, 8, 8, generator=generator), torch.arange(96) % 4)


class Crash(Exception):
    """A kill between two steps, as the run sees it."""


def crashing_loss(call: int):
    """Cross-entropy, raising Crash at its `call`-th call: the run stops after call - 1 micro-batches."""
    calls = 0

    def loss(outputs, target):
        nonlocal calls
        calls += 1
        if calls == call:
            raise Crash
        return nn.functional.cross_entropy(outputs, target)

    return loss


OLD_RUNS = """
import sys
import torch
from torch import nn
import gpukit as gk

torch.set_num_threads(1)  # as the one_thread fixture: the same kernels, the same sums
folder = sys.argv[1]
OPTIONS = {options!r}
{definitions}
torch.manual_seed(100)
model = dropout_cnn()
history = gk.fit(model, shuffled_images(), checkpoint_dir=folder + "/straight", save_every=2,
                 loss_fn=nn.functional.cross_entropy, **OPTIONS)
torch.save({{"state": model.state_dict(), "steps": history.steps, "epochs": history.epochs}}, folder + "/straight.pt")
torch.manual_seed(101)
try:  # killed at micro-batch 10 (step 4 of epoch 2): last.pt holds the save at step 8
    gk.fit(dropout_cnn(), shuffled_images(), checkpoint_dir=folder + "/stopped", save_every=2,
           loss_fn=crashing_loss(10), **OPTIONS)
except Crash:
    pass
torch.manual_seed(103)  # the two keywords folded into other options: label smoothing, a warm-up in steps
model = dropout_cnn()
history = gk.fit(model, shuffled_images(), checkpoint_dir=folder + "/smoothed", label_smoothing=0.1, warmup_steps=2,
                 schedule="linear", eval_data=shuffled_images(), **OPTIONS)
torch.save({{"state": model.state_dict(), "steps": history.steps, "epochs": history.epochs}}, folder + "/smoothed.pt")
"""


@pytest.fixture(scope="module")
def old_runs(tmp_path_factory):
    """The folder where the code of OLD_COMMIT trained (straight/, straight.pt) and was killed (stopped/)."""
    import shutil
    import subprocess
    import sys

    if (
        shutil.which("git") is None
        or subprocess.run(
            ["git", "-C", str(ROOT), "cat-file", "-e", f"{OLD_COMMIT}^{{commit}}"], capture_output=True, timeout=60
        ).returncode
    ):
        pytest.skip(f"commit {OLD_COMMIT} (the code before the option groups) is not in this clone (a shallow one?)")
    folder = tmp_path_factory.mktemp("before_the_groups")
    archive = subprocess.run(
        ["git", "-C", str(ROOT), "archive", OLD_COMMIT, "gpukit"], capture_output=True, check=True, timeout=120
    ).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True, timeout=120)
    definitions = "\n".join(inspect.getsource(f) for f in (dropout_cnn, shuffled_images, Crash, crashing_loss))
    script = OLD_RUNS.format(options=OPTIONS, definitions=definitions)
    subprocess.run(
        [sys.executable, "-c", script, str(folder)],
        cwd=folder,
        env={**os.environ, "PYTHONPATH": str(folder)},
        check=True,
        timeout=600,
    )
    return folder


def test_a_run_saved_by_the_code_before_the_groups_resumes_today_bit_exact(old_runs):
    """The old code's run, killed after step 9 and saved at step 8, resumed by today's fit (with the new spelling):
    the weights and every measured row of the old code's run never killed."""
    straight = torch.load(old_runs / "straight.pt", weights_only=False)
    torch.manual_seed(102)  # a new process starts with other generators: the resume must restore the saved ones
    model = dropout_cnn()
    saving = gk.Saving(old_runs / "stopped", every=2)
    history = gk.fit(model, shuffled_images(), saving=saving, loss_fn=nn.functional.cross_entropy, **OPTIONS)
    for name, value in straight["state"].items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert untimed(history.steps) == untimed(straight["steps"]) and len(history.steps) == 6
    assert untimed(history.epochs) == untimed(straight["epochs"])


def test_todays_fit_trains_as_the_code_before_the_groups_did(old_runs, tmp_path):
    """The same call to today's fit: the old code's weights, rows and saved state, its settings under the same keys."""
    from gpukit.train.checkpoint import read_checkpoint
    from tests.test_resume import assert_equal

    straight = torch.load(old_runs / "straight.pt", weights_only=False)
    torch.manual_seed(100)
    model = dropout_cnn()
    loss_fn = nn.functional.cross_entropy
    history = gk.fit(model, shuffled_images(), checkpoint_dir=tmp_path, save_every=2, loss_fn=loss_fn, **OPTIONS)
    for name, value in straight["state"].items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert untimed(history.steps) == untimed(straight["steps"])
    assert untimed(history.epochs) == untimed(straight["epochs"])
    old, new = read_checkpoint(old_runs / "straight" / "last.pt"), read_checkpoint(tmp_path / "last.pt")
    assert old.keys() == new.keys()
    for key in ("epoch", "step", "position", "plan", "settings", "model", "optimizer", "scheduler", "precision"):
        assert_equal(old[key], new[key], key)


def test_the_folded_keywords_train_and_save_as_the_code_before_them(old_runs, tmp_path):
    """label_smoothing=0.1 and warmup_steps=2 to the code before, and loss_fn=gk.CrossEntropy(0.1), warmup=2 today:
    the same weights, rows (eval_loss unsmoothed) and checkpoint settings, under the same keys."""
    from gpukit.train.checkpoint import read_checkpoint

    old = torch.load(old_runs / "smoothed.pt", weights_only=False)
    torch.manual_seed(103)
    model = dropout_cnn()
    history = gk.fit(
        model,
        shuffled_images(),
        saving=tmp_path,
        loss_fn=gk.CrossEntropy(0.1),
        warmup=2,
        schedule="linear",
        eval_data=shuffled_images(),
        **OPTIONS,
    )
    for name, value in old["state"].items():
        assert torch.equal(value, model.state_dict()[name]), name
    assert untimed(history.steps) == untimed(old["steps"]) and untimed(history.epochs) == untimed(old["epochs"])
    saved = read_checkpoint(old_runs / "smoothed" / "last.pt")["settings"]
    assert read_checkpoint(tmp_path / "last.pt")["settings"] == saved
    assert saved["label_smoothing"] == 0.1 and saved["warmup"] == 2

    # The old run goes on today under the new spelling (its settings match); another smoothing is refused, named.
    def go_on(smoothing):  # the old folder, one epoch more, in the new spelling
        more = dict(OPTIONS, epochs=3, warmup=2, schedule="linear")
        folder = old_runs / "smoothed"
        return gk.fit(dropout_cnn(), shuffled_images(), saving=folder, loss_fn=gk.CrossEntropy(smoothing), **more)

    with pytest.raises(gk.CheckpointError, match=r"changes label_smoothing \(0.1 → 0.2\)"):
        go_on(0.2)
    with pytest.warns(UserWarning, match="going on from the finished run"):
        extended = go_on(0.1)
    assert [row["epoch"] for row in extended.epochs] == [1, 2, 3]


FOLDED = {  # each keyword folded into another option: (model, data, the old spelling, the new)
    "warmup_steps": (small_cnn, image_batches, {"warmup_steps": 2}, {"warmup": 2}),
    "warmup_steps of a GPT": (
        tiny_gpt,
        token_batches,
        {"warmup_steps": 3, "schedule": "linear"},
        {"warmup": 3, "schedule": "linear"},
    ),
    "label_smoothing": (small_cnn, image_batches, {"label_smoothing": 0.1}, {"loss_fn": lambda: gk.CrossEntropy(0.1)}),
    "label_smoothing of a GPT": (
        tiny_gpt,
        token_batches,
        {"label_smoothing": 0.2, "loss_fn": "cross_entropy"},
        {"loss_fn": lambda: gk.CrossEntropy(label_smoothing=0.2)},
    ),
}


@pytest.mark.parametrize("case", FOLDED)
def test_each_folded_keyword_gives_the_run_of_its_new_spelling_to_the_bit(case, tmp_path, monkeypatch):
    make_model, make_data, old, new = FOLDED[case]
    held_out = {"eval_data": make_data()}
    old_history, old_state, _, old_said = run(make_model, make_data, {**old, **held_out}, tmp_path / "old", monkeypatch)
    new_history, new_state, _, new_said = run(make_model, make_data, {**new, **held_out}, tmp_path / "new", monkeypatch)
    assert untimed(old_history.steps) == untimed(new_history.steps) and old_history.steps
    assert untimed(old_history.epochs) == untimed(new_history.epochs) and "eval_loss" in old_history.epochs[0]
    assert all(torch.equal(old_state[k], new_state[k]) for k in old_state) and old_said == new_said == []
    # ... and not the run without it: the keyword did something.
    plain, *_ = run(make_model, make_data, held_out, tmp_path / "plain", monkeypatch)
    assert untimed(plain.steps) != untimed(new_history.steps)


def test_label_smoothing_is_for_training_only():
    """gk.CrossEntropy smooths the training loss, never the held-out one: measured against F.cross_entropy's own."""
    from gpukit.step import Loss

    generator = torch.Generator().manual_seed(0)
    logits, target = torch.randn(16, 5, generator=generator), torch.randint(0, 5, (16,), generator=generator)
    smoothed = nn.functional.cross_entropy(logits, target, label_smoothing=0.3)
    plain = nn.functional.cross_entropy(logits, target)
    assert not torch.isclose(smoothed, plain)
    assert torch.equal(Loss(gk.CrossEntropy(0.3))(logits, target), smoothed)
    assert torch.equal(Loss(gk.CrossEntropy(0.3), evaluation=True)(logits, target), plain)
    assert torch.equal(gk.CrossEntropy(0.3)(logits, target), smoothed)  # called alone: a loss of its own
    with pytest.raises(TypeError, match=r"label_smoothing must be a number in \[0, 1\), got '0.1'"):
        gk.CrossEntropy("0.1")


@pytest.mark.parametrize(
    "options, error, words",
    [
        ({"warmup_steps": 2, "warmup": 0.1}, TypeError, r"warmup_steps and warmup name the same option"),
        ({"warmup_steps": -1}, ValueError, r"warmup_steps must be an integer >= 0, got -1"),
        ({"warmup": -2}, ValueError, r"warmup must be an integer >= 0 \(an int is a number of optimizer steps\)"),
        ({"label_smoothing": 1.5}, ValueError, r"label_smoothing must lie in \[0, 1\), got 1.5"),
        ({"label_smoothing": math.nan}, ValueError, r"label_smoothing must lie in \[0, 1\), got nan"),
        ({"label_smoothing": 0.1, "loss_fn": "mse"}, ValueError, r"label_smoothing applies to the built-in cross-ent"),
        ({"label_smoothing": 0.1, "loss_fn": gk.CrossEntropy(0.1)}, ValueError, r"label_smoothing applies to the bu"),
        ({"loss_fn": gk.CrossEntropy}, TypeError, r"loss_fn=CrossEntropy is a class, not a loss: pass an instance"),
        ({"loss_fn": nn.MSELoss}, TypeError, r"loss_fn=MSELoss is a class, not a loss: pass an instance, e.g. MSE"),
    ],
)
def test_a_wrong_folded_keyword_is_refused_before_any_work_naming_it(options, error, words):
    with pytest.raises(error, match=words):
        gk.fit(nn.Linear(2, 2), Untouchable(), device="cpu", **options)
