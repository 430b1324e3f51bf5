"""Resume that is exact (issue 18 §2): a run killed between any two optimizer steps and run again with the same
checkpoint_dir ends bit-equal to a run never interrupted, for every data form (a Dataset fit shuffles, a DataLoader
with its own sampler or drawing from the global generator, DeviceLoader, TextLoader), with dropout, for every
optimizer; saving every N steps; going on from a finished run; refusing a changed setting; and the warning where a
loader's place cannot be saved. Models: a CNN with dropout, an LSTM with dropout, a small GPT with dropout, an MLP."""

import random
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler, Sampler, TensorDataset

import gpukit as gk
from gpukit.commands import cli
from gpukit.train.checkpoint import global_generators, read_checkpoint, restore_global_generators
from tests.helpers import raising_at, tiny_gpt

pytestmark = pytest.mark.usefixtures("one_thread")  # exact comparisons of tiny runs; no timing


class Crash(Exception):
    """What a kill between two steps looks like to the run: it stops, and nothing after it is saved."""


def crash_at(call: int, loss_fn=nn.functional.cross_entropy):
    """`loss_fn`, raising Crash at its `call`-th call: the run stops after call - 1 micro-batches."""
    return raising_at(call, loss_fn, Crash)


def disturb_generators(seed: int) -> None:
    """A new process starts with other global generators: a resume must not depend on them. Each rank of a
    distributed job gets its own (a resume must give each rank its own back)."""
    seed += 1000 * gk.distributed.rank()
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


# ---------------------------------------------------------------------------------------------
# Models and data: each builder gives a fresh, identical object, as a restarted script would


class LSTMClassifier(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.lstm = nn.LSTM(5, 12, num_layers=2, dropout=0.3, batch_first=True)
        self.dropout = nn.Dropout(0.2)
        self.head = nn.Linear(12, 4)

    def forward(self, sequences):  # (B, T, 5) -> (B, 4)
        return self.head(self.dropout(self.lstm(sequences)[0][:, -1]))


class NoisyImages(Dataset):
    """Images with noise drawn per item from NumPy's and Python's global generators (augmentation in the main
    process, as a user's transform would): their state must be saved too."""

    def __init__(self):
        generator = torch.Generator().manual_seed(3)
        self.images, self.labels = torch.randn(96, 3, 8, 8, generator=generator), torch.arange(96) % 4

    def __len__(self):
        return len(self.labels)

    def __getitem__(self, index):
        noise = torch.from_numpy(np.random.standard_normal((3, 8, 8)).astype(np.float32))
        return self.images[index] + 0.1 * noise * random.random(), self.labels[index]


def sequences() -> TensorDataset:
    generator = torch.Generator().manual_seed(4)
    return TensorDataset(torch.randn(96, 6, 5, generator=generator), torch.randint(0, 4, (96,), generator=generator))


def tokens():
    text = "".join(f"step {i} of the run, loss {i % 7}.\n" for i in range(60)).encode()[: 96 * 16 + 1]
    return gk.data.TokenDataset(torch.tensor(list(text), dtype=torch.uint8), seq_len=16)  # 96 windows


def small_cnn() -> nn.Module:
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=2), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(), nn.Linear(8 * 3 * 3, 4)
    )


def image_cnn() -> nn.Module:  # 32×32 shapes images
    torch.manual_seed(1)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, stride=4), nn.ReLU(), nn.Dropout(0.3), nn.Flatten(), nn.Linear(8 * 8 * 8, 10)
    )


FORMS = {
    # name: (model builder, data builder, fit options); every form gives 6 optimizer steps per epoch
    "dataset shuffled by fit": (small_cnn, NoisyImages, {"batch_size": 16}),
    "DataLoader with its own sampler": (
        LSTMClassifier,
        lambda: DataLoader(sequences(), batch_size=16, sampler=RandomSampler(range(96), generator=torch.Generator())),
        {},
    ),
    "DataLoader on the global generator": (
        LSTMClassifier,
        lambda: DataLoader(sequences(), batch_size=16, shuffle=True),
        {},
    ),
    "DeviceLoader with augmentation": (
        image_cnn,
        lambda: gk.data.DeviceLoader(gk.data.shapes(96, 0, seed=1)[0], 16, augment=True, device="cpu"),
        {},
    ),
    "TextLoader": (
        lambda: tiny_gpt(dropout=0.2, max_seq_len=16),
        lambda: gk.data.TextLoader(tokens(), 16, device="cpu", drop_last=True),
        {"optimizer": "adamw", "lr": 3e-3, "loss_fn": gk.step.cross_entropy},
    ),
}


def crash(make_model, make_data, directory, call: int, number: int = 0, **options) -> None:
    """Fit, killed at loss call `call`; the generators as the `number`-th start of a run (see train)."""
    loss_fn = options.pop("loss_fn", nn.functional.cross_entropy)
    model, data = make_model(), make_data()
    disturb_generators(100 + number)
    with pytest.raises(Crash):
        gk.fit(model, data, loss_fn=crash_at(call, loss_fn), checkpoint_dir=directory, **options)


def train(make_model, make_data, directory=None, crashes=(), **options):
    """Train to the end with `options`, killed at each loss call in `crashes` (counted afresh in each process)
    and run again each time. Returns (model, History). The first fit starts with the global generators seeded
    with 100, as an uninterrupted run's only fit does; each restart with others (101, 102, ...)."""
    for number, call in enumerate(crashes):
        crash(make_model, make_data, directory, call, number, **options)
    loss_fn = options.pop("loss_fn", nn.functional.cross_entropy)
    model, data = make_model(), make_data()
    disturb_generators(100 + len(crashes))
    return model, gk.fit(model, data, loss_fn=loss_fn, checkpoint_dir=directory, **options)


def assert_equal(a, b, where="") -> None:
    """Bit-equal, through dicts, lists and tuples: torch.equal on tensors (and the same dtype), == elsewhere."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), f"{where} differs"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_equal(a[key], b[key], f"{where}/{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for index, (x, y) in enumerate(zip(a, b)):
            assert_equal(x, y, f"{where}/{index}")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def assert_same_run(straight_dir, resumed_dir, straight: gk.History, resumed: gk.History) -> None:
    """The two final checkpoints hold the same weights, optimizer, schedule, scaler and generators, and the two
    Histories the same losses at the same steps."""
    a, b = read_checkpoint(straight_dir / "last.pt"), read_checkpoint(resumed_dir / "last.pt")
    for key in ("model", "optimizer", "scheduler", "precision", "ranks", "step", "epoch"):
        assert_equal(a[key], b[key], key)
    measured = ("loss", "lr", "step", "epoch")
    assert [[row[k] for k in measured] for row in straight.steps] == [
        [row[k] for k in measured] for row in resumed.steps
    ]
    assert [row["train_loss"] for row in straight.epochs] == [row["train_loss"] for row in resumed.epochs]


COMMON = dict(epochs=2, progress=False, device="cpu", log_every=2)


@pytest.mark.parametrize("form", FORMS)
def test_a_run_killed_anywhere_resumes_bit_equal(form, tmp_path):
    make_model, make_data, options = FORMS[form]
    options = COMMON | options | {"save_every": 3}
    straight, straight_history = train(make_model, make_data, tmp_path / "straight", **options)
    # Killed after step 4 (resumes from the save at step 3), after step 6 (the end of epoch 1, saved with its row)
    # and after step 10 of 12 (the save at step 9): three restarts in one run.
    resumed, resumed_history = train(make_model, make_data, tmp_path / "resumed", crashes=(5, 3, 5), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name
    assert [row["epoch"] for row in resumed_history.epochs] == [1, 2]


def test_saving_changes_nothing_in_the_run(tmp_path):
    """A run saved every step equals one never saved: the saves draw from no generator."""
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    plain, _ = train(make_model, make_data, **COMMON, **options)
    saved, _ = train(make_model, make_data, tmp_path, **COMMON, **options, save_every=1)
    for name, value in plain.state_dict().items():
        assert torch.equal(value, saved.state_dict()[name]), name


@pytest.mark.filterwarnings("ignore:optimizer='sgd' has meant:DeprecationWarning")
@pytest.mark.parametrize("optimizer", gk.optim.OPTIMIZERS)
def test_every_optimizer_resumes_bit_equal(optimizer, tmp_path):
    def mlp():
        torch.manual_seed(5)
        return nn.Sequential(
            nn.Linear(5, 16), nn.ReLU(), nn.Dropout(0.3), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
        )

    def data():
        inputs, labels = sequences().tensors
        return TensorDataset(inputs[:, 0], labels)  # 96 examples of 5 features, 4 classes

    options = COMMON | {"optimizer": optimizer, "batch_size": 8, "accumulate": 2, "save_every": 2}
    straight, straight_history = train(mlp, data, tmp_path / "straight", **options)
    # 12 micro-batches, 6 steps per epoch: killed after micro-batch 18 (step 9; the save at step 8 resumes).
    resumed, resumed_history = train(mlp, data, tmp_path / "resumed", crashes=(19,), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)


def test_save_every_saves_within_the_epoch(tmp_path):
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    crash(make_model, make_data, tmp_path, 9, **COMMON, **options, save_every=4)  # killed after step 8
    saved = read_checkpoint(tmp_path / "last.pt")
    assert (saved["epoch"], saved["step"], saved["position"]) == (1, 8, 2)  # epoch 2, after its second batch
    with pytest.raises(ValueError, match="save_every.*checkpoint_dir"):
        gk.fit(make_model(), make_data(), **COMMON, **options, save_every=4)
    with pytest.raises(ValueError, match="save_every"):
        gk.fit(make_model(), make_data(), **COMMON, **options, checkpoint_dir=tmp_path, save_every=0)


# ---------------------------------------------------------------------------------------------
# A loader whose place cannot be saved


class OwnOrder(Sampler):
    """A sampler whose order comes from a counter of its own: fit cannot know it (after a restart it would start
    from epoch 1's order again)."""

    def __init__(self, count: int):
        self.count, self.epochs = count, 0

    def __len__(self):
        return self.count

    def __iter__(self):
        self.epochs += 1
        return iter(torch.randperm(self.count, generator=torch.Generator().manual_seed(self.epochs)).tolist())


class SavedOrder(OwnOrder):
    """The same, with the state_dict()/load_state_dict() that say what decides its order."""

    def state_dict(self):
        return {"epochs": self.epochs}

    def load_state_dict(self, state):
        self.epochs = state["epochs"]


def test_a_loader_whose_place_cannot_be_saved_is_named(tmp_path):
    data = sequences()
    nothing = dict(epochs=0, progress=False, device="cpu")  # the warning comes before any work
    with pytest.warns(UserWarning, match=r"DataLoader passed as train_data.*sampler is a OwnOrder.*the Dataset"):
        gk.fit(LSTMClassifier(), DataLoader(data, 16, sampler=OwnOrder(96)), checkpoint_dir=tmp_path, **nothing)
    workers = DataLoader(data, 16, shuffle=True, num_workers=1, persistent_workers=True)
    with pytest.warns(UserWarning, match="persistent_workers=True"):
        gk.fit(LSTMClassifier(), workers, checkpoint_dir=tmp_path / "workers", **nothing)
    for stated in (DataLoader(data, 16, sampler=SavedOrder(96)), [data[:16], data[16:32]]):
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no warning where the order can be saved
            gk.fit(LSTMClassifier(), stated, checkpoint_dir=tmp_path / type(stated).__name__, **nothing)


def test_a_sampler_with_state_dict_resumes_bit_equal(tmp_path):
    def data():
        return DataLoader(sequences(), 16, sampler=SavedOrder(96))

    options = COMMON | {"save_every": 4}
    _, straight_history = train(LSTMClassifier, data, tmp_path / "straight", **options)
    _, resumed_history = train(LSTMClassifier, data, tmp_path / "resumed", crashes=(7, 3), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)


# ---------------------------------------------------------------------------------------------
# Going on from a finished run, and a call that changes the run


def test_a_finished_run_goes_on_with_a_new_schedule(tmp_path):
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    options = {**options, "progress": False, "device": "cpu", "log_every": 1, "checkpoint_dir": tmp_path}
    model = make_model()
    gk.fit(model, make_data(), epochs=1, lr=0.05, **options)
    with pytest.warns(UserWarning, match=r"finished run.*new 'onecycle' schedule \(peak lr 0.02"):
        history = gk.fit(model, make_data(), epochs=2, lr=0.02, **options)
    assert [row["epoch"] for row in history.epochs] == [1, 2] and len(history.steps) == 12
    # Epoch 2's learning rates are a fresh one-cycle schedule over its 6 steps at the new peak (each row: the lr its
    # step trained with).
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.02)
    schedule, expected = gk.optim.make_schedule(optimizer, "onecycle", 6, 0.2), []
    for _ in range(6):
        expected.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        schedule.step()
    assert [row["lr"] for row in history.steps[6:]] == pytest.approx(expected, rel=1e-12)
    # A finished run asked for fewer steps than it has is refused, saying so (not that the file is damaged).
    with pytest.raises(gk.CheckpointError, match="finished after 12 optimizer steps") as refused:
        gk.fit(make_model(), make_data(), epochs=1, lr=0.02, **options)
    assert "damaged" not in str(refused.value)


def test_an_extended_run_killed_midway_resumes_bit_equal(tmp_path):
    """The schedule of an extension spans the added steps, also after a resume (the linear one's lambda)."""
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    options = {**options, **COMMON, "schedule": "linear", "save_every": 2}
    histories = {}
    for name, crashes in (("straight", ()), ("resumed", (4,))):
        train(make_model, make_data, tmp_path / name, **(options | {"epochs": 1}))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "going on from the finished run": tested above
            histories[name] = train(make_model, make_data, tmp_path / name, crashes=crashes, **options)[1]
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", histories["straight"], histories["resumed"])


def test_an_unfinished_run_with_other_epochs_is_refused(tmp_path):
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    crash(make_model, make_data, tmp_path, 5, **COMMON, **options, save_every=2)
    with pytest.raises(gk.CheckpointError, match=r"stopped at optimizer step 4 of the 12 it planned.*finish it") as e:
        gk.fit(make_model(), make_data(), **(COMMON | {"epochs": 3}), **options, checkpoint_dir=tmp_path)
    assert "damaged" not in str(e.value)


@pytest.mark.parametrize(
    "change, named",
    [
        ({"lr": 0.1}, r"lr \(0.05 → 0.1\)"),
        ({"weight_decay": 1e-3}, r"weight_decay \(0.0005 → 0.001\)"),
        ({"optimizer": "adamw"}, r"optimizer \('nesterov' → 'adamw'\)"),
        ({"clip": 1.0}, r"clip \(None → 1.0\)"),
        ({"seed": 1}, r"seed \(0 → 1\)"),
        ({"batch_size": 8}, r"batch_size \(16 → 8\)"),
    ],
)
def test_a_changed_setting_on_resume_is_refused_by_name(change, named, tmp_path):
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    options = COMMON | options | {"lr": 0.05, "save_every": 2}
    crash(make_model, make_data, tmp_path, 5, **options)
    before = (tmp_path / "last.pt").read_bytes()
    model = make_model()
    with pytest.raises(gk.CheckpointError, match=named):
        gk.fit(model, make_data(), **(options | change), checkpoint_dir=tmp_path)
    assert (tmp_path / "last.pt").read_bytes() == before  # nothing trained, nothing saved
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), make_model().state_dict().values()))


# ---------------------------------------------------------------------------------------------
# CUDA: the device's generator (dropout, augmentation on the device), and batches copied on a side stream


def test_the_cuda_generator_is_saved_and_restored(fake_cuda):
    """Checked on a fake GPU (torch.cuda's own functions, with their device handling, over CPU generators)."""
    device = torch.device("cuda")  # no index: the current device's generator
    saved = global_generators(device)
    first = torch.randn(4, generator=torch.cuda.default_generators[0])
    restore_global_generators(saved, device)
    assert torch.equal(torch.randn(4, generator=torch.cuda.default_generators[0]), first)


@pytest.mark.gpu
@pytest.mark.parametrize("form", ["dataset shuffled by fit", "DeviceLoader on the GPU"])
def test_a_run_on_the_gpu_resumes_bit_equal(form, tmp_path, monkeypatch):
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)  # restored by conftest
    torch.backends.cudnn.deterministic = True
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    if form == "DeviceLoader on the GPU":
        make_model, options = image_cnn, {}

        def make_data():
            return gk.data.DeviceLoader(gk.data.shapes(96, 0, seed=1)[0], 16, augment=True, device="cuda")

    options = COMMON | options | {"device": "cuda", "save_every": 3}
    _, straight_history = train(make_model, make_data, tmp_path / "straight", **options)
    _, resumed_history = train(make_model, make_data, tmp_path / "resumed", crashes=(5, 3, 5), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)


def test_the_command_line_saves_every_n_steps(tmp_path, capsys):
    arguments = ["train", "--device", "cpu", "--train-size", "64", "--test-size", "16", "--epochs", "1"]
    arguments += ["--width", "4", "--batch-size", "16", "--no-progress", "--save-every", "3"]
    assert cli.main(arguments) == 2  # a bad input: one line, no traceback
    assert "save_every=3 saves into checkpoint_dir: pass checkpoint_dir too" in capsys.readouterr().err
    assert cli.main([*arguments, "--checkpoint-dir", str(tmp_path)]) == 0
    assert read_checkpoint(tmp_path / "last.pt")["step"] == 4


# ---------------------------------------------------------------------------------------------
# A distributed job: each rank's generators and running sums are its own


def two_rank_resume(folder):
    gk.distributed.setup()
    make_model, make_data, options = FORMS["dataset shuffled by fit"]  # 48 examples a rank: 3 steps an epoch
    options = COMMON | options | {"save_every": 2}
    results = {}
    # Killed after step 2 (resumes from the save at step 2, mid-epoch) and after step 3 (from the epoch's end).
    for name, crashes in (("straight", ()), ("resumed", (3, 2))):
        model, history = train(make_model, make_data, Path(folder) / name, crashes=crashes, **options)
        results[name] = {"model": model.state_dict(), "history": history}
    gk.distributed.cleanup()
    return results


def test_a_distributed_run_resumes_bit_equal_on_every_rank(tmp_path):
    ranks = gk.distributed.launch(two_rank_resume, 2, str(tmp_path), backend="gloo", timeout=240)
    assert_same_run(
        tmp_path / "straight", tmp_path / "resumed", ranks[0]["straight"]["history"], ranks[0]["resumed"]["history"]
    )
    for rank in ranks:
        assert_equal(rank["straight"]["model"], rank["resumed"]["model"], "model")
    saved = read_checkpoint(tmp_path / "resumed" / "last.pt")["ranks"]
    assert len(saved) == 2 and not torch.equal(saved[0]["generators"]["torch"], saved[1]["generators"]["torch"])


# ---------------------------------------------------------------------------------------------
# Lost runs (issue "Never lose or corrupt a run")


def test_a_run_killed_between_its_epochs_last_save_and_the_epochs_end_resumes(tmp_path):
    """save_every=3 saves at step 6, the epoch's last, before its evaluation; a kill during that evaluation left a
    save at the epoch's very end, and every resume of it failed (UnboundLocalError 'batch' in _train_epoch)."""
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    generator = torch.Generator().manual_seed(6)
    eval_data = TensorDataset(torch.randn(4, 3, 8, 8, generator=generator), torch.arange(4))  # one batch
    options = COMMON | options | {"save_every": 3, "log_every": 4, "eval_data": eval_data}
    straight, straight_history = train(make_model, make_data, tmp_path / "straight", **options)
    # Loss call 1 is the check of eval_data before any work, 2-7 epoch 1's steps, 8 its evaluation: killed there,
    # after the save at step 6.
    resumed, resumed_history = train(make_model, make_data, tmp_path / "resumed", crashes=(8,), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)
    assert [row["epoch"] for row in resumed_history.epochs] == [1, 2]
