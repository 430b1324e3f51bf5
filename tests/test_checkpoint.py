"""Saving a run and resuming it: `fit(checkpoint_dir=...)` (a checkpoint is saved training state), on a
CNN and on a GPT; the checksum that refuses a damaged or truncated file; the atomic writes behind it, and what
a save killed mid-write leaves. Exact resume for every data form and optimizer: tests/test_resume.py."""

import copy
import multiprocessing
import multiprocessing.forkserver
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import gpukit as gk
from gpukit.train import checkpoint as checkpoint_module
from gpukit.train.checkpoint import read_checkpoint, write_checkpoint
from tests.helpers import tiny_gpt
from tests.test_resume import COMMON, FORMS, assert_same_run, disturb_generators, train


class Crash(Exception):
    pass


def crash_at(call: int, loss_fn):
    calls = 0

    def crashing(*args):
        nonlocal calls
        calls += 1
        if calls == call:
            raise Crash
        return loss_fn(*args)

    return crashing


@pytest.mark.parametrize("kind", ["cnn", "gpt"])
def test_resume_after_a_crash_equals_an_uninterrupted_run(kind, small_data, corpus, tmp_path, device):
    if kind == "cnn":
        torch.manual_seed(0)
        data, options = small_data[0], dict(batch_size=64, lr=0.05)
        straight, loss_fn = gk.models.fast_cnn(4), nn.functional.cross_entropy  # epoch 1 has 8 batches
    else:
        data, options = corpus[0], dict(batch_size=64, lr=3e-3, optimizer="adamw")
        straight, loss_fn = tiny_gpt(), gk.step.cross_entropy  # epoch 1 has 2,400 // 16 // 64 = 2 batches
    crashed, resumed = copy.deepcopy(straight), copy.deepcopy(straight)
    common = dict(epochs=2, progress=False, seed=7, device=device, **options)
    gk.fit(straight, data, loss_fn=loss_fn, **common)
    with pytest.raises(Crash):
        gk.fit(crashed, data, **common, loss_fn=crash_at(10 if kind == "cnn" else 3, loss_fn), checkpoint_dir=tmp_path)
    history = gk.fit(resumed, data, **common, loss_fn=loss_fn, checkpoint_dir=tmp_path)  # picks up at epoch 2
    assert [row["epoch"] for row in history.epochs] == [1, 2]
    for a, b in zip(straight.state_dict().values(), resumed.state_dict().values()):
        assert torch.equal(a, b)  # bit-equal: the data order and every generator were saved


def test_corrupt_or_mismatched_checkpoint_is_an_error(small_data, tmp_path, device):
    train, _ = small_data
    common = dict(progress=False, checkpoint_dir=tmp_path, device=device)
    gk.fit(gk.models.fast_cnn(4), train, epochs=1, batch_size=64, **common)
    with pytest.raises(gk.CheckpointError, match=r"cannot resume from .*another model's weights \(0.0.weight is"):
        gk.fit(gk.models.fast_cnn(8), train, epochs=2, batch_size=64, **common)
    with pytest.raises(gk.CheckpointError, match=r"changes batch_size \(64 → 32\).*number of processes"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=3, batch_size=32, **common)
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(gk.CheckpointError, match="cannot resume from .*last.pt: it is truncated, or no gpukit"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=2, batch_size=64, **common)


# ---------------------------------------------------------------------------------------------
# Integrity: a checksum checked before torch.load, and no temporary file left behind


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A small finished run's checkpoint: (its bytes, the model trained)."""
    folder = tmp_path_factory.mktemp("saved")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 64), nn.ReLU(), nn.Linear(64, 3))
    data = [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)]
    gk.fit(model, data, epochs=1, progress=False, device="cpu", checkpoint_dir=folder)
    return (folder / "last.pt").read_bytes(), model


def test_a_checkpoint_stays_readable_by_torch_load(saved_run, tmp_path):
    whole, model = saved_run
    (tmp_path / "last.pt").write_bytes(whole)
    weights = torch.load(tmp_path / "last.pt", weights_only=True)["model"]  # without gpukit, as it is
    assert all(torch.equal(weights[name], value) for name, value in model.state_dict().items())


def test_a_damaged_checkpoint_is_refused_naming_the_file(saved_run, tmp_path):
    whole, model = saved_run
    weight = model[0].weight.detach().numpy().tobytes()  # 64 × 6 float32, stored as they are
    at = whole.index(weight) + 100
    flipped = whole[:at] + bytes(b ^ 0xFF for b in whole[at : at + 8]) + whole[at + 8 :]
    path = tmp_path / "last.pt"
    path.write_bytes(flipped)
    # Without the checksum, torch.load reads the damaged file without complaint, and other weights come out:
    unchecked = torch.load(path, weights_only=True)["model"]["0.weight"]
    assert not torch.equal(unchecked, model[0].weight)
    with pytest.raises(gk.CheckpointError, match=f"cannot resume from {path}: it is damaged"):
        read_checkpoint(path)
    for fraction in (0.5, 0.9):
        path.write_bytes(whole[: int(len(whole) * fraction)])
        with pytest.raises(gk.CheckpointError, match=f"cannot resume from {path}: it is truncated"):
            read_checkpoint(path)
    path.write_bytes(whole[: whole.rindex(b"\ngpukit-checkpoint")])  # cut exactly before its checksum line
    with pytest.raises(gk.CheckpointError, match="a gpukit save cut short exactly before its checksum line"):
        read_checkpoint(path)
    path.unlink()
    path.mkdir()  # unreadable as a file: named, not a bare OSError
    with pytest.raises(gk.CheckpointError, match=f"cannot resume from {path}"):
        read_checkpoint(path)


def dead_process_id() -> int:
    finished = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(finished.stdout)


def test_temporary_files_of_killed_saves_are_removed_and_never_read(saved_run, tmp_path):
    whole, _ = saved_run
    (tmp_path / "last.pt").write_bytes(whole)
    dead = tmp_path / f".last.pt.{dead_process_id()}.tmp"  # a save killed mid-write
    alive = tmp_path / f".last.pt.{os.getppid()}.tmp"  # a process still running: it may be writing now
    for leftover in (dead, alive):
        leftover.write_bytes(b"half a checkpoint")
    assert read_checkpoint(tmp_path / "last.pt")["step"] == 4
    assert not dead.exists() and alive.exists()
    dead.write_bytes(b"half a checkpoint")
    write_checkpoint({"step": 5}, tmp_path / "last.pt")  # a save cleans up too
    assert sorted(path.name for path in tmp_path.iterdir()) == [alive.name, "last.pt"]


def test_a_save_killed_by_sigkill_leaves_the_previous_checkpoint(tmp_path):
    """A real SIGKILL in the middle of a save (the temporary file written, not yet renamed), then a resume."""
    script = (
        "import os, signal, sys, torch\n"
        "torch.set_num_threads(1)\n"
        "from tests.test_resume import COMMON, FORMS, train\n"
        "saves, fsync = 0, os.fsync\n"
        "def killed_on_the_third_save(descriptor):\n"
        "    global saves\n"
        "    saves += 1\n"
        "    if saves == 3:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "    fsync(descriptor)\n"
        "os.fsync = killed_on_the_third_save\n"
        "model, data, options = FORMS['dataset shuffled by fit']\n"
        "train(model, data, sys.argv[1], **COMMON, **options, save_every=2)\n"
    )
    root = Path(__file__).resolve().parents[1]
    environment = os.environ | {"PYTHONPATH": str(root), "OMP_NUM_THREADS": "1"}
    killed = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "resumed")], cwd=root, env=environment, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL
    leftovers = list((tmp_path / "resumed").glob(".last.pt.*.tmp"))
    assert len(leftovers) == 1 and leftovers[0].stat().st_size > 0  # the save cut short, of checkpoint size
    assert read_checkpoint(tmp_path / "resumed" / "last.pt")["step"] == 4  # the previous save, intact
    torch.set_num_threads(1)  # as in the killed process (restored by conftest)
    make_model, make_data, options = FORMS["dataset shuffled by fit"]
    options = COMMON | options | {"save_every": 2}
    _, straight = train(make_model, make_data, tmp_path / "straight", **options)
    _, resumed = train(make_model, make_data, tmp_path / "resumed", crashes=(), **options)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight, resumed)
    assert not list((tmp_path / "resumed").glob(".*.tmp"))


# A run killed by SIGKILL at random moments: each life of it is a process forked from a fork server that imported
# torch and gpukit once (a spawned process imports them again: 14-17 s each on this 2-core machine at load 7, where a
# fork takes milliseconds); the server never runs an op, so forking from it is as safe as spawning (no OpenMP region
# entered, no autograd threads, no CUDA).
HELD_OUT = TensorDataset(torch.randn(8, 3, 8, 8, generator=torch.Generator().manual_seed(9)), torch.arange(8) % 4)
# 12 optimizer steps per epoch, 2 epochs, a save after every step and an evaluation after each epoch; dropout, and
# augmentation drawn from NumPy's and Python's generators.
KILLED_RUN = (*FORMS["dataset shuffled by fit"][:2], COMMON | {"batch_size": 8, "save_every": 1, "eval_data": HELD_OUT})


def counting(function, at: int, reached):
    """`function`, setting the event `reached` as its `at`-th call begins (0: never)."""
    calls = 0

    def counted(*args, **kwargs):
        nonlocal calls
        calls += 1
        if calls == at:
            reached.set()
        return function(*args, **kwargs)

    return counted


def live_until_killed(directory: str, life: int, trigger: tuple[str, int], reached, history_path: str) -> None:
    """One life of the run in `directory`: resume from its last save and train to the end, setting `reached` at the
    trigger ("loss", n): the n-th loss call of this life (evaluation's too), or ("save", n): the n-th save begins."""
    torch.set_num_threads(1)  # as the uninterrupted run (the test's one_thread)
    make_model, make_data, options = KILLED_RUN
    kind, at = trigger
    loss_fn = counting(nn.functional.cross_entropy, at if kind == "loss" else 0, reached)
    checkpoint_module.write_checkpoint = counting(
        checkpoint_module.write_checkpoint, at if kind == "save" else 0, reached
    )
    disturb_generators(100 + life)  # each life starts with other generators: the resume must restore them
    history = gk.fit(make_model(), make_data(), loss_fn=loss_fn, checkpoint_dir=directory, **options)
    history.save(history_path)


@pytest.fixture
def fork_server():
    """A multiprocessing context whose processes fork from a server that imported torch, gpukit and this module once;
    the server is stopped afterwards."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        pytest.skip("no fork server on this platform (Windows)")
    context = multiprocessing.get_context("forkserver")
    # torch._dynamo: what building the first optimizer imports (10 s of a first fit at load 8-10 here).
    context.set_forkserver_preload(["torch", "torch._dynamo", "gpukit", "tests.test_checkpoint"])
    multiprocessing.forkserver.ensure_running()  # it imports them while the test trains its uninterrupted run
    yield context
    multiprocessing.forkserver._forkserver._stop()
    context.set_forkserver_preload([])


@pytest.mark.usefixtures("one_thread")
def test_a_run_sigkilled_at_random_moments_resumes_bit_equal(fork_server, tmp_path):
    """Five lives killed with SIGKILL a random 0-10 ms after a seeded random event in the first half of what each
    has to train (a loss call, or the start of a save: a save takes ~60 ms here, so those kills land inside it),
    each leaving a folder that resumes; then a life to the end: the same weights, optimizer, schedule, generators
    and rows as a run never interrupted. (A kill at a chosen point of a save: the test above.)"""
    make_model, make_data, options = KILLED_RUN
    straight, straight_history = train(make_model, make_data, tmp_path / "straight", **options)
    directory, draw, kills = tmp_path / "killed", random.Random(0), 0
    for life in range(6):
        saved = read_checkpoint(directory / "last.pt")["step"] if (directory / "last.pt").exists() else 0
        remaining = 24 - saved  # optimizer steps still to train, each a save and a loss call
        trigger = (draw.choice(["loss", "save"]), draw.randint(1, max(remaining // 2, 1))) if life < 5 else ("", 0)
        reached = fork_server.Event()
        process = fork_server.Process(
            target=live_until_killed, args=(str(directory), life, trigger, reached, str(tmp_path / "history.json"))
        )
        process.start()
        if life < 5 and reached.wait(120):
            time.sleep(draw.uniform(0, 0.01))
            process.kill()
        process.join(120)
        if process.exitcode == 0:
            break
        assert process.exitcode == -signal.SIGKILL, f"life {life} ({trigger}) ended with exit code {process.exitcode}"
        kills += 1
        read_checkpoint(directory / "last.pt")  # what a kill leaves is always a checkpoint that reads (or none)
    assert process.exitcode == 0 and kills >= 3, kills
    resumed_history = gk.History.load(tmp_path / "history.json")
    assert_same_run(tmp_path / "straight", directory, straight_history, resumed_history)
    saved = read_checkpoint(directory / "last.pt")["model"]
    assert all(torch.equal(value, saved[name]) for name, value in straight.state_dict().items())
    assert not list(directory.glob(".*.tmp"))


def test_atomic_save_keeps_the_old_file_when_writing_fails(tmp_path, monkeypatch):
    path = tmp_path / "state.pt"
    gk.files.save_atomic({"value": 1}, path)

    def broken_save(obj, file):
        file.write(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        gk.files.save_atomic({"value": 2}, path)
    monkeypatch.undo()
    assert torch.load(path)["value"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["state.pt"]  # no temporary file left behind


# ---------------------------------------------------------------------------------------------
# Never a non-finite state over a good save (issue "Never lose or corrupt a run", 1)


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 32), nn.ReLU(), nn.Linear(32, 3))


def poisoned_from(call: int, loss_fn):
    """`loss_fn`, its loss NaN from its `call`-th call on: the gradients, then the weights, become NaN there (what a
    too-high lr does, at a step chosen here)."""
    calls = 0

    def poisoned(*args):
        nonlocal calls
        calls += 1
        loss = loss_fn(*args)
        return loss * float("nan") if calls >= call else loss

    return poisoned


KINDS = {  # model, data (4 batches an epoch), fit options
    "mlp": (mlp, lambda: [(torch.randn(8, 6), torch.randint(0, 3, (8,))) for _ in range(4)], {}),
    "gpt": (tiny_gpt, lambda: [(t[:, :-1], t[:, 1:]) for t in tiny_tokens()], {"optimizer": "adamw", "lr": 3e-3}),
}


def tiny_tokens() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, 256, (4, 17), generator=generator) for _ in range(4)]


@pytest.mark.parametrize("kind", KINDS)
def test_a_non_finite_state_is_never_saved_over_a_good_one(kind, tmp_path):
    """A finished run extended with save_every=1, whose weights become NaN at its 3rd added step: the loss is read
    every log_every=10 steps, so the saves came first and wrote NaN over last.pt; a resume reloaded NaN."""
    make_model, make_data, options = KINDS[kind]
    torch.manual_seed(0)
    data = make_data()
    loss_fn = nn.functional.cross_entropy if kind == "mlp" else gk.step.cross_entropy
    common = dict(progress=False, device="cpu", checkpoint_dir=tmp_path, **options)
    model = make_model()
    gk.fit(model, data, epochs=1, loss_fn=loss_fn, **common)  # 4 good steps, saved
    good = read_checkpoint(tmp_path / "last.pt")
    with pytest.warns(UserWarning, match="finished run"):
        with pytest.raises(gk.train.NonFiniteLossError, match=r"not saved.*last good save.*step 6 \(epoch 2\)") as e:
            gk.fit(model, data, epochs=2, loss_fn=poisoned_from(3, loss_fn), save_every=1, log_every=10, **common)
    assert str(tmp_path / "last.pt") in str(e.value)
    saved = read_checkpoint(tmp_path / "last.pt")
    assert saved["step"] == 6 and good["step"] == 4  # steps 5 and 6 were finite and saved; step 7 was not
    assert all(value.isfinite().all() for value in saved["model"].values() if value.is_floating_point())
    # The run goes on from the last good save (here with the same, now finite, loss).
    resumed = make_model()
    history = gk.fit(resumed, data, epochs=2, loss_fn=loss_fn, save_every=1, **common)
    assert [row["epoch"] for row in history.epochs] == [1, 2] and history.steps[-1]["step"] == 8
    assert all(value.isfinite().all() for value in resumed.state_dict().values() if value.is_floating_point())


# ---------------------------------------------------------------------------------------------
# One live run per folder (issue "Never lose or corrupt a run", 2)


class WaitingData:
    """mlp's 4 batches, given only once `finish` is set; `started` is set when fit first reads them (it holds its
    folder by then)."""

    def __init__(self, started, finish):
        self.started, self.finish = started, finish

    def __len__(self):
        return 4

    def __iter__(self):
        self.started.set()
        self.finish.wait(120)
        return iter(mlp_batches())


def mlp_batches() -> list:
    generator = torch.Generator().manual_seed(2)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 3, (8,), generator=generator)) for _ in range(4)]


def train_when_told(folder: str, started, finish) -> None:
    torch.set_num_threads(1)
    gk.fit(mlp(), WaitingData(started, finish), epochs=1, progress=False, device="cpu", checkpoint_dir=folder)


def start_training_elsewhere(folder: Path):
    """Another process (spawned, as a second notebook is) that trains in `folder` until its `finish` is set."""
    context = multiprocessing.get_context("spawn")
    started, finish = context.Event(), context.Event()
    process = context.Process(target=train_when_told, args=(str(folder), started, finish))
    process.start()
    assert started.wait(120), "the other process did not start training"
    return process, finish


def test_a_folder_another_live_run_trains_in_is_refused(tmp_path):
    """Two notebooks on one checkpoint_dir both returned without a word; the last rename won, the other run was gone."""
    options = dict(epochs=1, progress=False, device="cpu", checkpoint_dir=tmp_path)
    other, finish = start_training_elsewhere(tmp_path)
    try:
        with pytest.raises(gk.train.FolderInUseError, match=rf"checkpoint_dir {tmp_path} is in use.*{other.pid}"):
            gk.fit(mlp(), mlp_batches(), **options)
        assert not (tmp_path / "last.pt").exists()  # refused before any work: the other run's first save is to come
    finally:
        finish.set()
        other.join(120)
    assert other.exitcode == 0 and read_checkpoint(tmp_path / "last.pt")["step"] == 4
    model = mlp()
    gk.fit(model, mlp_batches(), **options)  # the folder is free again: its finished run is loaded, nothing trained
    saved = read_checkpoint(tmp_path / "last.pt")["model"]
    assert all(torch.equal(value, saved[name]) for name, value in model.state_dict().items())


def test_a_killed_run_does_not_hold_its_folder(tmp_path):
    other, _ = start_training_elsewhere(tmp_path)
    other.kill()  # SIGKILL: no finally, no cleanup
    other.join(120)
    history = gk.fit(mlp(), mlp_batches(), epochs=1, progress=False, device="cpu", checkpoint_dir=tmp_path)
    assert history.steps[-1]["step"] == 4 and read_checkpoint(tmp_path / "last.pt")["step"] == 4
