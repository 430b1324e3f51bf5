"""Runs you can keep and compare: History.save / load / to_csv, fit(log_dir=...) TensorBoard scalars
read back with TensorBoard's own reader, gk.plots.compare, and the bad input of each. Every feature is
checked on two kinds of model: the CNN on image batches and the GPT on (B, T) token batches."""

import csv
import json
import math
import os
import subprocess
import sys
import time

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch.utils.data import TensorDataset
from torch.utils.tensorboard import SummaryWriter

import gpukit as gk
from gpukit import runfile
from gpukit.data import shapes
from gpukit.train import HistoryFileError
from gpukit.train.tensorboard_log import TensorBoardLog
from tests.helpers import small_mlp, tiny_gpt, tokens
from tests.test_resume import train

matplotlib.use("Agg")  # figures are drawn, never shown


def token_accuracy_top2(outputs, target):
    """A metric of the GPT run only: the share of target tokens among the two highest logits."""
    return (outputs.topk(2, dim=-1).indices == target[..., None]).any(-1).float().mean()


def small_cnn(seed=0):
    """A convolution and a classifier: a CNN on image batches that trains in milliseconds per step."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.GELU(), torch.nn.Flatten(), torch.nn.Linear(8 * 15 * 15, 10)
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{kind: (history, log_dir, values passed to the TensorBoard writer)} for a CNN and a GPT run."""
    folder = tmp_path_factory.mktemp("runs")
    images, held_out_images = shapes(128, 32, seed=1)
    text, held_out_text = gk.data.text(
        gk.__file__.replace("__init__.py", ""), seq_len=16, max_bytes=4_000, pattern="*.py"
    )
    results = {}
    with pytest.MonkeyPatch.context() as patch:
        written = []
        original = SummaryWriter.add_scalar

        def spy(self, tag, value, *args, **kwargs):
            written.append(value)
            return original(self, tag, value, *args, **kwargs)

        patch.setattr(SummaryWriter, "add_scalar", spy)
        results["cnn"] = gk.fit(
            small_cnn(),
            images,
            epochs=2,
            batch_size=32,
            eval_data=held_out_images,
            device="cpu",
            progress=False,
            log_every=3,
            log_dir=folder / "cnn",
        )
        cnn_written, written[:] = list(written), []
        torch.manual_seed(0)
        gpt = gk.models.gpt(max_seq_len=16, width=32, depth=1, heads=2)
        results["gpt"] = gk.fit(
            gpt,
            text,
            epochs=2,
            batch_size=32,
            lr=3e-3,
            optimizer="adamw",
            eval_data=held_out_text,
            metrics={"top2": token_accuracy_top2},
            device="cpu",
            progress=False,
            log_every=4,
            log_dir=folder / "gpt",
        )
    return {
        "cnn": (results["cnn"], folder / "cnn", cnn_written),
        "gpt": (results["gpt"], folder / "gpt", list(written)),
    }


KINDS = ["cnn", "gpt"]


# ---------------------------------------------------------------------------------------------
# save, load, to_csv


@pytest.mark.parametrize("kind", KINDS)
def test_save_and_load_give_back_every_column_exactly(runs, kind, tmp_path):
    history = runs[kind][0]
    path = history.save(tmp_path / "run.json")
    loaded = gk.History.load(path)
    assert loaded.steps == history.steps and loaded.epochs == history.epochs  # float ==: bit for bit
    for saved_rows, rows in ((loaded.steps, history.steps), (loaded.epochs, history.epochs)):
        for saved_row, row in zip(saved_rows, rows, strict=True):
            assert list(saved_row) == list(row)  # same columns, same order
            assert [type(v) for v in saved_row.values()] == [type(v) for v in row.values()]  # ints stay ints
    assert loaded == history  # every field: precision, device, batch_size, sample_name, seconds, environment
    assert loaded.summary() == history.summary()
    # The file itself, read as plain JSON: a format marker, a version, the environment.
    record = json.loads(path.read_text())
    assert record["format"] == "gpukit.History" and record["version"] == 1
    assert record["environment"]["precision"] == "fp32" and record["environment"]["device"] == "cpu"
    assert record["history"]["steps"] == history.steps


def test_fit_records_the_environment(runs):
    environment = runs["cnn"][0].environment
    assert environment["profile"] == gk.env.profile_for("cpu").name  # the sizes for the device it trained on
    assert environment["torch"] == torch.__version__
    assert environment["python"] == ".".join(map(str, sys.version_info[:3]))
    assert environment["device_name"]  # this CPU's model name
    inside_git = subprocess.run(["git", "rev-parse", "--is-inside-work-tree"], capture_output=True, text=True)
    if inside_git.returncode == 0:  # the tests run from a checkout: fit saw the commit that git log reports
        head = subprocess.run(["git", "log", "-1", "--format=%H"], capture_output=True, text=True).stdout.strip()
        assert environment["git_commit"] == head
    else:
        assert environment["git_commit"] is None


def test_git_commit_is_none_outside_a_checkout_and_without_git(tmp_path, monkeypatch):
    assert runfile.git_commit(tmp_path) is None  # a plain folder
    subprocess.run(["git", "init", "-q", str(tmp_path)], check=True)
    assert runfile.git_commit(tmp_path) is None  # a repository before its first commit
    (tmp_path / "a.txt").write_text("a")
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "add", "a.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "a"], check=True)
    head = subprocess.run([*git, "log", "-1", "--format=%H"], capture_output=True, text=True).stdout.strip()
    assert runfile.git_commit(tmp_path) == head
    monkeypatch.setenv("PATH", "")  # no git at all: the commit is read from the repository's files
    assert runfile.git_commit(tmp_path) == head
    assert runfile.git_commit(tmp_path / "missing") is None  # git cannot run in a folder that is gone
    (tmp_path / "plain").mkdir()
    monkeypatch.chdir(tmp_path.parent)  # tmp_path's parent is no repository
    assert runfile.git_commit() is None
    monkeypatch.setenv("GIT_DIR", str(tmp_path / ".git"))  # the files cannot say what git would do: git is asked
    assert runfile.git_commit(tmp_path / "plain") is None


def test_git_commit_read_from_files_agrees_with_git(tmp_path, monkeypatch):
    """Packed refs, a detached HEAD, a linked worktree and a subfolder: what the files say is what git says."""
    git = ["git", "-C", str(tmp_path / "repo"), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(["git", "init", "-q", str(tmp_path / "repo")], check=True)
    (tmp_path / "repo" / "sub").mkdir()
    for text in "ab":
        (tmp_path / "repo" / "sub" / "a.txt").write_text(text)
        subprocess.run([*git, "add", "sub/a.txt"], check=True)
        subprocess.run([*git, "commit", "-qm", text], check=True)

    def rev_parse(folder):
        result = subprocess.run(["git", "-C", str(folder), "rev-parse", "HEAD"], capture_output=True, text=True)
        return result.stdout.strip()

    def no_git(*args, **kwargs):
        raise AssertionError("git was started although the repository's files tell the commit")

    def read_from_files(folder):
        with monkeypatch.context() as patch:
            patch.setattr(subprocess, "run", no_git)
            return runfile.git_commit(folder)

    subprocess.run([*git, "worktree", "add", "-q", str(tmp_path / "tree"), "-b", "other"], check=True)
    subprocess.run([*git, "pack-refs", "--all"], check=True)  # branches now only in packed-refs
    folders = [tmp_path / "repo", tmp_path / "repo" / "sub", tmp_path / "tree"]
    assert [read_from_files(folder) for folder in folders] == [rev_parse(folder) for folder in folders]
    latest = rev_parse(tmp_path / "repo")
    subprocess.run([*git, "checkout", "-q", "--detach", "HEAD~1"], check=True)
    assert read_from_files(tmp_path / "repo") == rev_parse(tmp_path / "repo") != latest
    assert len(latest) == 40


def test_a_history_not_made_by_fit_saves_this_process_environment(tmp_path):
    history = gk.History(epochs=[{"epoch": 1, "train_loss": 0.5, "seconds": 1.0}])
    loaded = gk.History.load(history.save(tmp_path / "hand.json"))
    assert loaded.epochs == history.epochs
    assert loaded.environment["torch"] == torch.__version__ and loaded.environment["device_name"] is None


@pytest.mark.parametrize("kind", KINDS)
def test_to_csv_writes_each_table_with_exact_numbers(runs, kind, tmp_path):
    history = runs[kind][0]
    for rows, expected in (("epochs", history.epochs), ("steps", history.steps)):
        path = history.to_csv(tmp_path / "more" / f"{rows}.csv", rows=rows)  # the folder is created
        with open(path, newline="") as file:
            table = list(csv.DictReader(file))
        assert len(table) == len(expected)
        for cells, row in zip(table, expected):
            assert list(cells) == list(row)
            for column, value in row.items():
                assert cells[column] == "" if value is None else float(cells[column]) == value, (column, cells, row)
    with pytest.raises(ValueError, match="rows='epochs' or rows='steps'"):
        history.to_csv(tmp_path / "x.csv", rows="both")


# ---------------------------------------------------------------------------------------------
# save and load: bad input


def test_save_creates_a_missing_folder_and_replaces_a_saved_history(runs, tmp_path):
    history = runs["cnn"][0]
    path = tmp_path / "not" / "yet" / "there" / "run.json"
    history.save(path)
    runs["gpt"][0].save(path)  # a saved History may be replaced
    assert gk.History.load(path).sample_name == "sequence"
    assert os.listdir(path.parent) == ["run.json"]  # no temporary file left behind


@pytest.mark.parametrize(
    "content",
    [b"my notes, not a run\n", b'{"format": "something else", "version": 1}', b"[1, 2, 3]", b"\x80\x02\x00binary"],
    ids=["text", "other-json", "json-list", "binary"],
)
def test_save_refuses_to_overwrite_a_file_that_is_not_a_history(runs, tmp_path, content):
    path = tmp_path / "precious.json"
    path.write_bytes(content)
    with pytest.raises(FileExistsError, match="not a saved History.*choose another path"):
        runs["cnn"][0].save(path)
    assert path.read_bytes() == content
    with pytest.raises(IsADirectoryError, match="is a folder"):
        runs["cnn"][0].save(tmp_path)


def test_a_failed_save_leaves_the_previous_file_whole(runs, tmp_path, monkeypatch):
    path = runs["cnn"][0].save(tmp_path / "run.json")
    before = path.read_bytes()

    def disk_full(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", disk_full)  # the write fails after part of the file was written
    with pytest.raises(OSError, match="No space left"):
        runs["gpt"][0].save(path)
    monkeypatch.undo()
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["run.json"]
    unstorable = gk.History(epochs=[{"epoch": 1, "train_loss": object()}])
    with pytest.raises(TypeError, match="JSON cannot store"):
        unstorable.save(path)
    assert path.read_bytes() == before
    numpy_numbers = gk.History(epochs=[{"epoch": np.int64(1), "train_loss": np.float32(0.5)}])
    assert gk.History.load(numpy_numbers.save(tmp_path / "np.json")).epochs == [{"epoch": 1, "train_loss": 0.5}]


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (b"epoch,loss\n1,0.5\n", "not a saved History.*not a JSON object"),
        (b"\x80\x02\x00binary", "not a saved History.*not a JSON object"),
        (b'{"epochs": [1, 2', "not a saved History.*not JSON"),
        (b'{"format": "\xff"}', "not a saved History.*not JSON"),
        (b'{"epochs": []}', 'not a saved History.*"format": "gpukit.History"'),
        (b"[1, 2]", "not a saved History.*not a JSON object"),
        (b'{"format": "gpukit.History", "version": "one"}', "damaged.*format version"),
        (b'{"format": "gpukit.History", "version": 1, "history": {}}', "damaged.*steps and epochs"),
        (b'{"format": "gpukit.History", "version": 99, "history": {}}', "newer gpukit.*format 99.*upgrade gpukit"),
    ],
    ids=[
        "csv",
        "binary",
        "cut-short",
        "not-utf8",
        "json-without-format",
        "json-list",
        "bad-version",
        "damaged",
        "newer-version",
    ],
)
def test_load_says_what_is_wrong_with_the_file(tmp_path, content, message):
    path = tmp_path / "run.json"
    path.write_bytes(content)
    with pytest.raises(HistoryFileError, match=message):
        gk.History.load(path)
    with pytest.raises(HistoryFileError, match=message):  # compare reads saved runs the same way
        gk.plots.compare([path])


def saved_by_hand(tmp_path, change):
    """A History with one step row and one epoch row, saved, then its history entry changed by `change`."""
    history = gk.History(
        steps=[{"step": 1, "epoch": 1, "loss": 1.5, "lr": 0.1, "step_time": 0.01, "samples_per_second": 800.0}],
        epochs=[{"epoch": 1, "train_loss": 1.5, "eval_accuracy": None, "seconds": 0.5}],
    )
    path = history.save(tmp_path / "run.json")
    record = json.loads(path.read_text())
    change(record["history"])
    path.write_text(json.dumps(record))
    return path


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda h: h["steps"][0].update(loss="1.5"), r"steps row 1 has loss='1.5', not a number"),
        (lambda h: h["steps"][0].pop("step_time"), r"steps row 1 has no 'step_time' column"),
        (lambda h: h["epochs"][0].update(epoch="1"), r"epochs row 1 has epoch='1', not an integer"),
        (lambda h: h["epochs"][0].pop("epoch"), r"epochs row 1 has no 'epoch' column"),
        (lambda h: h["epochs"][0].update(train_loss=[1.5]), r"epochs row 1 has train_loss=\[1.5\], not a number"),
        (lambda h: h["epochs"].append([2, 0.7]), r"epochs row 2 is \[2, 0.7\], not an object of columns"),
        (lambda h: h.update(micro_batch_size="8"), r"its micro_batch_size is '8', not an integer"),
    ],
    ids=["loss-string", "no-step-time", "epoch-string", "no-epoch", "metric-list", "row-list", "batch-size-string"],
)
def test_load_refuses_rows_of_wrong_types_or_missing_columns(tmp_path, change, message):
    """Accepted before, then a KeyError or TypeError deep in summary() or compare(); now refused at load."""
    path = saved_by_hand(tmp_path, change)
    for load in (gk.History.load, lambda path: gk.plots.compare([path])):
        with pytest.raises(HistoryFileError, match=rf"run\.json is damaged: {message}; save the run again"):
            load(path)


def test_load_keeps_accepting_what_save_writes(tmp_path):
    loaded = gk.History.load(saved_by_hand(tmp_path, lambda history: None))
    assert loaded.summary()["step_time_ms"] == 10.0 and loaded.epochs[0]["eval_accuracy"] is None


def test_load_of_a_folder_names_it_and_the_files_inside(tmp_path):
    saved_by_hand(tmp_path, lambda history: None)
    for load in (gk.History.load, lambda path: gk.plots.compare([path])):
        with pytest.raises(IsADirectoryError, match=r"is a folder, not a saved History: pass the JSON file.*run\.json"):
            load(tmp_path)


def test_load_of_a_missing_file_names_it(tmp_path):
    with pytest.raises(FileNotFoundError, match="no saved History at .*nothing.json"):
        gk.History.load(tmp_path / "nothing.json")


# ---------------------------------------------------------------------------------------------
# TensorBoard


def scalars(log_dir) -> dict[str, list[tuple[int, float]]]:
    """Every scalar in a log folder as TensorBoard itself reads it: {tag: [(step, value), ...]}."""
    accumulator = EventAccumulator(str(log_dir))
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def expected_scalars(history) -> dict[str, list[tuple[int, float]]]:
    """What History holds, as TensorBoard stores it (32-bit floats): numeric columns by step and by epoch."""
    expected = {}
    for group, rows, index, skip in (
        ("steps", history.steps, "step", ("step", "epoch")),
        ("epochs", history.epochs, "epoch", ("epoch",)),
    ):
        for row in rows:
            for column, value in row.items():
                if column not in skip and value is not None:
                    expected.setdefault(f"{group}/{column}", []).append((row[index], float(np.float32(value))))
    return expected


@pytest.mark.parametrize("kind", KINDS)
def test_tensorboard_holds_every_logged_row_of_the_history(runs, kind):
    history, log_dir, written = runs[kind]
    found = scalars(log_dir)
    assert found == expected_scalars(history)
    assert {"steps/loss", "steps/lr", "steps/samples_per_second", "epochs/train_loss", "epochs/eval_loss"} <= set(found)
    if kind == "gpt":
        assert {"steps/tokens_per_second", "epochs/train_top2", "epochs/eval_top2"} <= set(found)
    # Python numbers only: writing a log point never reads a tensor (no extra wait for the device).
    assert written and all(type(value) in (int, float) for value in written)


def test_tensorboard_writes_every_numeric_epoch_column(tmp_path):
    log = TensorBoardLog(tmp_path)
    log.add_epoch(
        {
            "epoch": 1,
            "train_loss": 0.5,
            "peak_memory": 3 * 2**30,
            "energy_joules": 41.5,
            "note": "text",
            "warm": True,
            "eval_loss": None,
        }
    )
    log.close()
    found = scalars(tmp_path)
    assert found == {
        "epochs/train_loss": [(1, 0.5)],
        "epochs/peak_memory": [(1, 3 * 2**30)],
        "epochs/energy_joules": [(1, 41.5)],
    }


class CountingModel(torch.nn.Sequential):
    calls = 0

    def forward(self, inputs):
        CountingModel.calls += 1
        return super().forward(inputs)


def counting_cnn():
    CountingModel.calls = 0
    return CountingModel(torch.nn.Flatten(), torch.nn.Linear(3 * 32 * 32, 10))


@pytest.fixture(scope="module")
def images():
    return shapes(64, 16, seed=2)[0]


@pytest.mark.parametrize("where", ["a-file", "under-a-file"])
def test_a_log_dir_that_cannot_be_written_fails_before_training(images, tmp_path, where):
    (tmp_path / "notes.txt").write_text("a file, not a folder")
    log_dir = tmp_path / "notes.txt" if where == "a-file" else tmp_path / "notes.txt" / "run"
    with pytest.raises(ValueError, match="log_dir=.*(is a file|cannot be written).*folder"):
        gk.fit(counting_cnn(), images, batch_size=16, device="cpu", progress=False, log_dir=log_dir)
    assert CountingModel.calls == 0


@pytest.mark.skipif(hasattr(os, "geteuid") and os.geteuid() == 0, reason="root writes into read-only folders")
def test_a_read_only_log_dir_fails_before_training(images, tmp_path):
    (tmp_path / "locked").mkdir(mode=0o500)
    with pytest.raises(ValueError, match="cannot be written"):
        gk.fit(counting_cnn(), images, batch_size=16, device="cpu", progress=False, log_dir=tmp_path / "locked")
    assert CountingModel.calls == 0


def test_without_tensorboard_log_dir_names_the_extra(images, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    with pytest.raises(ImportError, match=r"tensorboard.*pip install 'gpukit\[log\]'"):
        gk.fit(counting_cnn(), images, batch_size=16, device="cpu", progress=False, log_dir=tmp_path / "tb")
    assert CountingModel.calls == 0
    history = gk.fit(counting_cnn(), images, batch_size=16, device="cpu", progress=False)  # no log_dir: no need
    assert history.epochs


# ---------------------------------------------------------------------------------------------
# compare


def test_compare_draws_runs_of_two_kinds_from_objects_and_files(runs, tmp_path):
    cnn, gpt = runs["cnn"][0], runs["gpt"][0]
    gpt_path = gpt.save(tmp_path / "gpt small.json")
    figure, table = gk.plots.compare([cnn, gpt_path])
    loss_axis, *metric_axes = figure.axes
    assert [axis.get_ylabel() for axis in metric_axes] == ["loss", "accuracy", "top2"]
    # The curves are the runs' own numbers: the loss per logged step, against the optimizer step.
    lines = {line.get_label(): line for line in loss_axis.get_lines()}
    assert list(lines) == ["run 1", "gpt small"]
    assert list(lines["run 1"].get_ydata()) == cnn.losses and list(lines["gpt small"].get_xdata()) == [
        row["step"] for row in gpt.steps
    ]
    top2 = {line.get_label() for line in metric_axes[2].get_lines()}
    assert top2 == {"gpt small, train", "gpt small, held-out"}  # a metric only one run has
    # The table: one row per run, final values as each History gives them, throughput, wall time.
    assert table.column("run") == ["run 1", "gpt small"]
    assert table.column("eval_loss") == [cnn.final_eval_loss, gpt.final_eval_loss]
    assert table.column("seconds") == [cnn.seconds, gpt.seconds]
    assert table.column("images_per_second") == [cnn.images_per_second, None]
    assert table.column("tokens_per_second") == [None, gpt.tokens_per_second]
    assert table.column("eval_top2") == [None, gpt.final("eval_top2")]
    plt.close(figure)


def test_compare_with_labels_and_chosen_metrics(runs):
    cnn, gpt = runs["cnn"][0], runs["gpt"][0]
    figure, table = gk.plots.compare({"cnn": cnn, "gpt": gpt}, metrics=["accuracy"])
    assert len(figure.axes) == 2 and table.column("run") == ["cnn", "gpt"]
    plt.close(figure)
    figure, _ = gk.plots.compare([cnn, cnn], labels=["a", "b"], metrics="loss")
    assert [line.get_label() for line in figure.axes[0].get_lines()] == ["a", "b"]
    plt.close(figure)


def test_compare_bad_input_says_what_to_do(runs, tmp_path):
    cnn = runs["cnn"][0]
    with pytest.raises(ValueError, match="no run has 'mae' per epoch; these runs have loss, accuracy"):
        gk.plots.compare([cnn], metrics=["mae"])
    with pytest.raises(ValueError, match="labels must be 2 different names"):
        gk.plots.compare([cnn, cnn], labels=["only one"])
    with pytest.raises(ValueError, match="labels must be 2 different names"):
        gk.plots.compare([cnn, cnn], labels=["same", "same"])
    with pytest.raises(ValueError, match="a list of runs"):
        gk.plots.compare([])
    with pytest.raises(ValueError, match="a list of runs"):
        gk.plots.compare(tmp_path / "run.json")  # one path, not a list
    with pytest.raises(TypeError, match="History objects or paths.*got a dict"):
        gk.plots.compare([cnn.summary()])
    with pytest.raises(FileNotFoundError, match="no saved History"):
        gk.plots.compare([tmp_path / "missing.json"])


def test_default_labels_are_distinct(runs, tmp_path):
    cnn = runs["cnn"][0]
    first, second = cnn.save(tmp_path / "a" / "run.json"), cnn.save(tmp_path / "b" / "run.json")
    figure, table = gk.plots.compare([first, second])
    plt.close(figure)
    assert table.column("run") == ["run (1)", "run (2)"]
    assert math.isclose(table[0]["seconds"], cnn.seconds)


# ---------------------------------------------------------------------------------------------
# The lr column: the lr each logged step trained with, every parameter group's


def recording_lrs(build):
    """(a function of the parameters for fit's optimizer=, the list it fills): `build`'s optimizer with a hook that
    records each group's lr as optimizer.step begins, which is the lr that step trains with."""
    trained = []

    def built(parameters):
        optimizer = build(parameters)
        optimizer.register_step_pre_hook(
            lambda optimizer, args, kwargs: trained.append([group["lr"] for group in optimizer.param_groups])
        )
        return optimizer

    return built, trained


def one_group(parameters):
    return torch.optim.AdamW(parameters, lr=1e-3)


def two_groups(parameters):
    """The first half of the parameters at 1e-3, the rest at 1e-2: two groups whose lrs differ at every step."""
    parameters = list(parameters)
    half = len(parameters) // 2
    return torch.optim.AdamW([{"params": parameters[:half], "lr": 1e-3}, {"params": parameters[half:], "lr": 1e-2}])


def row_lrs(row: dict) -> list[float]:
    """A History.steps row's lr of each parameter group: lr, then lr_group1, lr_group2, ..."""
    return [row["lr"]] + [row[f"lr_group{group}"] for group in range(1, 1 + sum(k.startswith("lr_group") for k in row))]


def mlp_features():
    """96 samples of 6 features, 4 classes: 6 optimizer steps per epoch at batch_size 16."""
    generator = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(96, 6, generator=generator), torch.randint(0, 4, (96,), generator=generator))


def gpt_tokens():
    """6 batches of 4 windows of 16 byte tokens, each target the next token: 6 optimizer steps per epoch."""
    windows = tokens(24, 17, seed=7)
    return [(windows[i : i + 4, :-1], windows[i : i + 4, 1:]) for i in range(0, 24, 4)]


LR_MODELS = {
    "mlp": (small_mlp, mlp_features, {"batch_size": 16}),
    "gpt": (lambda: tiny_gpt(max_seq_len=16), gpt_tokens, {}),
}


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("log_every", [1, 4])
@pytest.mark.parametrize("build", [one_group, two_groups])
@pytest.mark.parametrize("kind", LR_MODELS)
def test_each_row_shows_the_lr_its_step_trained_with(kind, build, log_every):
    """The rows read the next step's lr (warm-up rows 0.0005, 0.00075, 0.001 where the steps trained at 0.00025,
    0.0005, 0.00075), and the first parameter group's alone."""
    make_model, make_data, options = LR_MODELS[kind]
    optimizer, trained = recording_lrs(build)
    history = gk.fit(
        make_model(),
        make_data(),
        **options,
        optimizer=optimizer,
        schedule="linear",
        warmup_steps=3,
        epochs=2,
        log_every=log_every,
        progress=False,
        device="cpu",
    )
    assert len(trained) == 12  # 6 steps in each of 2 epochs
    steps = [row["step"] for row in history.steps]
    assert steps == (list(range(1, 13)) if log_every == 1 else [4, 6, 10, 12])  # each epoch's last step ends a row
    for row in history.steps:  # a row of several steps shows its last step's lr (the step it is logged at)
        assert row_lrs(row) == trained[row["step"] - 1], row["step"]
    groups = 2 if build is two_groups else 1
    assert all(len(row_lrs(row)) == groups for row in history.steps)  # a column per group whose lr differs
    if log_every == 1:  # the warm-up's first step trains at a quarter of the peak: (0 + 1) / (3 + 1)
        assert row_lrs(history.steps[0]) == pytest.approx([1e-3 / 4, 1e-2 / 4][:groups], rel=1e-12)


@pytest.mark.usefixtures("one_thread")
def test_a_resumed_run_logs_the_rows_of_an_uninterrupted_one(tmp_path):
    """Two groups, a row every 4 steps (6 per epoch), saves every 3: killed in step 5 (resumed from the save at step
    3, in the middle of a row's window), then in epoch 1's evaluation (resumed from the save at step 6, whose window
    holds steps 5 and 6: that row is logged from the saved window alone)."""
    held_out = TensorDataset(torch.randn(4, 6, generator=torch.Generator().manual_seed(8)), torch.arange(4))
    options = dict(
        batch_size=16,
        optimizer=two_groups,
        schedule="linear",
        warmup_steps=3,
        epochs=2,
        log_every=4,
        save_every=3,
        eval_data=held_out,
        progress=False,
        device="cpu",
    )
    _, straight = train(small_mlp, mlp_features, tmp_path / "straight", **options)
    # Loss call 1 checks eval_data before any work; calls 2-7 are epoch 1's steps, 8 its evaluation. After the
    # resume from step 3: call 1 the check, 2-4 steps 4-6, 5 the evaluation.
    _, resumed = train(small_mlp, mlp_features, tmp_path / "resumed", crashes=(6, 5), **options)
    timed = ("step_time", "samples_per_second")
    assert [{k: v for k, v in row.items() if k not in timed} for row in resumed.steps] == [
        {k: v for k, v in row.items() if k not in timed} for row in straight.steps
    ]
    assert [row["step"] for row in straight.steps] == [4, 6, 10, 12] and "lr_group1" in straight.steps[0]


@pytest.mark.usefixtures("one_thread")
def test_every_groups_lr_is_saved_loaded_exported_and_logged(tmp_path):
    optimizer, trained = recording_lrs(two_groups)
    history = gk.fit(
        small_mlp(),
        mlp_features(),
        batch_size=16,
        optimizer=optimizer,
        schedule="linear",
        warmup_steps=3,
        log_every=1,
        progress=False,
        device="cpu",
        log_dir=tmp_path / "log",
    )
    assert [row_lrs(row) for row in history.steps] == trained
    assert gk.History.load(history.save(tmp_path / "run.json")).steps == history.steps
    with open(history.to_csv(tmp_path / "steps.csv", rows="steps")) as file:
        assert [[float(row["lr"]), float(row["lr_group1"])] for row in csv.DictReader(file)] == trained
    assert scalars(tmp_path / "log")["steps/lr_group1"] == [
        (step, float(np.float32(lrs[1]))) for step, lrs in enumerate(trained, 1)
    ]
    figure, table = gk.plots.compare([history, tmp_path / "run.json"])
    plt.close(figure)
    plt.close(history.plot())
    assert len(table) == 2


class SlowFirstItem(TensorDataset):
    """Held-out data whose first item takes `pause` seconds to read: fit reads it in its setup's checks."""

    def __init__(self, pause: float, *tensors):
        super().__init__(*tensors)
        self.pause, self.read = pause, False

    def __getitem__(self, index):
        if not self.read:
            self.read = True
            time.sleep(self.pause)
        return super().__getitem__(index)


@pytest.mark.parametrize("kind", ["mlp", "gpt"])
def test_history_seconds_is_the_whole_call_by_a_hand_clock(kind):
    """History.seconds holds fit's checks and building too (where torch.compile's import and wrapping cost seconds):
    its setup reading eval_data's slow first item counts, and the whole is within the hand clock around the call."""
    generator = torch.Generator().manual_seed(0)
    if kind == "mlp":
        model, inputs = small_mlp(), torch.randn(64, 6, generator=generator)
        data = TensorDataset(inputs, torch.randint(0, 4, (64,), generator=generator))
        held_out = SlowFirstItem(0.4, inputs[:16], torch.randint(0, 4, (16,), generator=generator))
    else:
        model, ids = tiny_gpt(), torch.randint(0, 64, (32, 17), generator=generator)
        data = TensorDataset(ids[:, :-1], ids[:, 1:])
        held_out = SlowFirstItem(0.4, ids[:8, :-1], ids[:8, 1:])
    started = time.perf_counter()
    history = gk.fit(model, data, eval_data=held_out, batch_size=16, progress=False, device="cpu")
    by_hand = time.perf_counter() - started
    assert held_out.read and 0.4 <= history.seconds <= by_hand, (history.seconds, by_hand)
    # The wrappers around it cost little: a History's clock half the call's fails (a stall of 0.2 s does not).
    assert history.seconds >= 0.8 * by_hand - 0.2, (history.seconds, by_hand)
