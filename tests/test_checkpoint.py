"""Saving a run and resuming it: `fit(checkpoint_dir=...)` (a checkpoint is saved training state), on a
CNN and on a GPT, and the atomic writes behind it."""

import copy

import pytest
import torch
from torch import nn

import gpukit as gk
from tests.helpers import tiny_gpt


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
        torch.testing.assert_close(a, b)


def test_corrupt_or_mismatched_checkpoint_is_an_error(small_data, tmp_path, device):
    train, _ = small_data
    common = dict(progress=False, checkpoint_dir=tmp_path, device=device)
    gk.fit(gk.models.fast_cnn(4), train, epochs=1, batch_size=64, **common)
    with pytest.raises(RuntimeError, match="cannot resume"):
        gk.fit(gk.models.fast_cnn(8), train, epochs=2, batch_size=64, **common)
    with pytest.raises(RuntimeError, match="resume with the same epochs"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=3, batch_size=32, **common)
    (tmp_path / "last.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(RuntimeError, match="cannot resume"):
        gk.fit(gk.models.fast_cnn(4), train, epochs=2, batch_size=64, **common)


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
