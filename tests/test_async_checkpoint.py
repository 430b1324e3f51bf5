"""Saves written in the background (issue 21 §6): the file holds the state as it was when save() returned, whatever
training changes afterwards; a process killed mid-write leaves the previous complete last.pt, never half a file;
an error in the writer is raised in training; fit(save_in_background=True) resumes bit-equal, on a CNN and a GPT."""

import subprocess
import sys
import textwrap
import time

import pytest
import torch

import gpukit as gk
from gpukit.train.async_checkpoint import BackgroundWriter, snapshot
from gpukit.train.checkpoint import read_checkpoint, write_checkpoint
from tests.test_resume import COMMON, FORMS, assert_same_run, train

pytestmark = pytest.mark.usefixtures("one_thread")


def test_the_file_holds_the_state_as_save_returned_it(tmp_path):
    weights = torch.zeros(1000)
    state = {"model": {"weight": weights}, "history": {"steps": [1, 2]}, "step": 3}
    writer = BackgroundWriter()
    writer.save(state, tmp_path / "last.pt")
    weights += 1  # the next optimizer step, in place, while the thread may still be writing
    state["history"]["steps"].append(3)
    writer.wait()
    saved = read_checkpoint(tmp_path / "last.pt")
    assert torch.equal(saved["model"]["weight"], torch.zeros(1000))
    assert saved["history"]["steps"] == [1, 2] and saved["step"] == 3
    assert len(writer.blocked) == 1 and writer.blocked[0] >= 0


def test_snapshot_copies_every_tensor_and_value():
    state = {"weights": [torch.ones(3)], "rng": (torch.ByteTensor([1, 2]), 5), "name": "run"}
    copied = snapshot(state)
    state["weights"][0].zero_()
    assert torch.equal(copied["weights"][0], torch.ones(3)) and copied["rng"][1] == 5 and copied["name"] == "run"
    assert copied["rng"][0].data_ptr() != state["rng"][0].data_ptr()


def test_snapshot_keeps_tied_weights_tied_and_views_as_they_were():
    model = gk.models.gpt(width=16, depth=1, heads=2, max_seq_len=8)  # head.weight is the token embedding's
    state = model.state_dict() | {"view": model.blocks[0].mlp[0].weight[2:5, 1:]}
    copied = snapshot(state)
    assert copied["head.weight"].data_ptr() == copied["token_embedding.weight"].data_ptr()
    for name, tensor in state.items():
        assert torch.equal(copied[name], tensor) and copied[name].stride() == tensor.stride(), name


def test_an_error_in_the_writer_is_raised_in_training_and_the_last_file_stays(tmp_path):
    path = tmp_path / "last.pt"
    write_checkpoint({"step": 1}, path)

    def failing(state, path):
        raise OSError("no space left on device")

    writer = BackgroundWriter(failing)
    writer.save({"step": 2}, path)
    with pytest.raises(RuntimeError, match="no space left.*last complete file is still in place"):
        writer.wait()
    assert read_checkpoint(path)["step"] == 1


KILLED_MID_WRITE = textwrap.dedent(
    """
    import os, sys, time, torch
    from gpukit.train import async_checkpoint
    from gpukit.train.checkpoint import write_checkpoint

    path = sys.argv[1]
    write_checkpoint({"step": 1, "weights": torch.ones(1000)}, path)  # the previous, complete save

    class Slow:  # torch.save writes through it: a slow disk, killed halfway
        def __init__(self, file):
            self.file, self.written = file, 0
        def write(self, data):
            self.written += len(data)
            if self.written > 2_000_000:
                os.kill(os.getpid(), 9)  # the process dies mid-write, as a preempted job does
            return self.file.write(data)
        def flush(self):
            self.file.flush()

    def slow_write(state, target):
        from gpukit.files import write_atomic
        write_atomic(target, lambda file: torch.save(state, Slow(file)))

    writer = async_checkpoint.BackgroundWriter(slow_write)
    writer.save({"step": 2, "weights": torch.zeros(2_000_000)}, path)  # 8 MB
    time.sleep(60)
    """
)


def test_a_process_killed_mid_write_leaves_the_previous_complete_file(tmp_path):
    path = tmp_path / "last.pt"
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", KILLED_MID_WRITE, str(path)], capture_output=True, timeout=120)
    assert done.returncode == -9, done.stderr.decode()[-2000:]  # killed, not finished
    assert time.monotonic() - started < 60
    leftovers = [file.name for file in tmp_path.iterdir() if file.name != "last.pt"]
    assert leftovers and all(name.endswith(".tmp") for name in leftovers)  # the half-written temporary file
    saved = read_checkpoint(path)  # the previous save, whole (and the leftover temporary removed)
    assert saved["step"] == 1 and torch.equal(saved["weights"], torch.ones(1000))
    assert [file.name for file in tmp_path.iterdir()] == ["last.pt"]


@pytest.mark.parametrize("form", ["dataset shuffled by fit", "TextLoader"])  # a CNN and a GPT
def test_fit_saving_in_the_background_resumes_bit_equal(form, tmp_path):
    make_model, make_data, options = FORMS[form]
    options = COMMON | options | {"save_every": 3}
    straight, straight_history = train(make_model, make_data, tmp_path / "straight", **options)
    background = options | {"save_in_background": True}
    resumed, resumed_history = train(make_model, make_data, tmp_path / "resumed", crashes=(5, 3), **background)
    assert_same_run(tmp_path / "straight", tmp_path / "resumed", straight_history, resumed_history)
    for name, value in straight.state_dict().items():
        assert torch.equal(value, resumed.state_dict()[name]), name


def test_save_in_background_needs_a_checkpoint_dir():
    with pytest.raises(ValueError, match="checkpoint_dir"):
        gk.fit(torch.nn.Linear(2, 2), [(torch.ones(1, 2), torch.ones(1, 2))], device="cpu", save_in_background=True)
