"""A save or a resume that cannot go on says why and what to do, before any work where that can be known, and keeps
the last good save (issue "Never lose or corrupt a run", obscure errors of checkpoints and filesystems). Each case
here ended in an error from deep inside torch or Python (a raw OSError, a KeyError, "File exists"), or in none.

A full or read-only disk is simulated by patching the write (as root, chmod cannot make a folder read-only)."""

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gpukit as gk
from gpukit.train import checks
from gpukit.train.checkpoint import read_checkpoint, write_checkpoint
from tests.helpers import small_mlp

pytestmark = pytest.mark.usefixtures("one_thread")

CPU = torch.device("cpu")
COMMON = dict(progress=False, device=CPU)


def mlp_batches() -> list:
    """4 batches of 8 examples of 6 features, 4 classes: 4 optimizer steps an epoch."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=generator), torch.randint(0, 4, (8,), generator=generator)) for _ in range(4)]


def saved_epoch(folder: Path, model: nn.Module | None = None, **options) -> nn.Module:
    """One epoch trained and saved in `folder` (last.pt at optimizer step 4); returns the model."""
    model = small_mlp() if model is None else model
    gk.fit(model, mlp_batches(), epochs=1, checkpoint_dir=folder, **COMMON, **options)
    assert read_checkpoint(folder / "last.pt")["step"] == 4
    return model


def same_weights(a: nn.Module, b: nn.Module) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))


# ---------------------------------------------------------------------------------------------
# A disk that fills up or turns read-only during a save


class Refusing:
    """A file whose every write fails as the disk does."""

    def __init__(self, code: int):
        self.code = code

    def write(self, data):
        raise OSError(self.code, os.strerror(self.code))


def save_refused(code: int, how: str, real):
    """`real` (torch.save or os.replace) as it is at the first save, then refused by the disk with `code`."""
    calls = 0

    def refused_in_write(state, file):  # what a Python file's write raises on a full disk
        file.write(b"x" * 1000)
        raise OSError(code, os.strerror(code))

    def refused_in_torch(state, file):  # torch's zip writer turns it into "unexpected pos" where it sees it first
        file.write(b"x" * 1000)
        file.file = Refusing(code)
        try:
            file.write(b"x" * 1000)
        except OSError:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1000 vs 598") from None

    def refused_in_rename(source, target):  # the file written, the filesystem read-only by the rename
        raise OSError(code, os.strerror(code), str(target))

    def refused_from_the_second(*args):
        nonlocal calls
        calls += 1
        refused = {"write": refused_in_write, "torch": refused_in_torch, "rename": refused_in_rename}[how]
        return real(*args) if calls == 1 else refused(*args)

    return refused_from_the_second


@pytest.mark.parametrize("background", [False, True], ids=["blocking", "in the background"])
@pytest.mark.parametrize("how", ["write", "torch", "rename"])
@pytest.mark.parametrize(
    "code, cause, fix",
    [(errno.ENOSPC, "disk is full", "free space"), (errno.EROFS, "read-only", "remount it writable")],
    ids=["full", "read-only"],
)
def test_a_disk_that_refuses_a_save_is_named_and_the_last_good_save_kept(
    code, cause, fix, how, background, tmp_path, monkeypatch
):
    """A 3-epoch run whose disk refuses every save after epoch 1's: it stops, and the same call resumes later."""
    if how == "rename":
        monkeypatch.setattr(os, "replace", save_refused(code, how, os.replace))
    else:
        monkeypatch.setattr(torch, "save", save_refused(code, how, torch.save))
    options = dict(epochs=3, checkpoint_dir=tmp_path, **COMMON)
    with pytest.raises(gk.CheckpointError) as refused:
        gk.fit(small_mlp(), mlp_batches(), save_in_background=background, **options)
    monkeypatch.undo()
    message = str(refused.value)
    assert cause in message and fix in message and f"cannot save the run in {tmp_path}:" in message
    # the save kept, named by its file and step (in the background the failure of epoch 2's save is seen at epoch 3's)
    assert f"{tmp_path / 'last.pt'} keeps the last good save: optimizer step 4 (epoch 1)" in message
    assert "call fit again with that folder as checkpoint_dir" in message
    assert read_checkpoint(tmp_path / "last.pt")["step"] == 4  # intact, and nothing half-written beside it
    assert sorted(path.name for path in tmp_path.iterdir()) == [".gpukit.lock", "last.pt"]
    history = gk.fit(small_mlp(), mlp_batches(), **options)  # room again: it goes on from epoch 2
    assert [row["epoch"] for row in history.epochs] == [1, 2, 3] and history.steps[-1]["step"] == 12


def test_a_disk_without_room_for_the_weights_is_refused_before_any_work(tmp_path, monkeypatch):
    model, untouched = small_mlp(), small_mlp()
    free = 500  # bytes: less than the MLP's 180 float32 weights (720 bytes)
    monkeypatch.setattr(checks.shutil, "disk_usage", lambda path: Usage(free))
    with pytest.raises(ValueError, match=rf"checkpoint_dir '{tmp_path}' is on a disk with 500 B free.*alone, 720 B"):
        gk.fit(model, mlp_batches(), epochs=1, checkpoint_dir=tmp_path, **COMMON)
    assert same_weights(model, untouched) and not (tmp_path / "last.pt").exists()


class Usage:
    def __init__(self, free: int):
        self.total, self.used, self.free = 10**9, 10**9 - free, free


# ---------------------------------------------------------------------------------------------
# A checkpoint_dir or last.pt that is not what a save needs: refused before any work


def test_a_last_pt_that_is_a_folder_is_refused_before_any_work(tmp_path):
    (tmp_path / "last.pt").mkdir()
    model, untouched = small_mlp(), small_mlp()
    with pytest.raises(gk.CheckpointError, match=rf"{tmp_path / 'last.pt'}: it is a folder.*move or rename"):
        gk.fit(model, mlp_batches(), epochs=1, checkpoint_dir=tmp_path, **COMMON)
    assert same_weights(model, untouched) and (tmp_path / "last.pt").is_dir()


@pytest.mark.parametrize("kind", ["dangling", "dangling above", "loop"])
def test_a_checkpoint_dir_through_a_broken_link_is_refused_naming_it(kind, tmp_path):
    link = tmp_path / "link"
    if kind == "loop":
        (tmp_path / "other").symlink_to(link)
        link.symlink_to(tmp_path / "other")
    else:
        link.symlink_to(tmp_path / "nowhere")
    folder = link / "run" if kind == "dangling above" else link
    said = "in a loop" if kind == "loop" else f"to {tmp_path / 'nowhere'}, which does not exist"
    model, untouched = small_mlp(), small_mlp()
    with pytest.raises(
        ValueError, match=rf"checkpoint_dir '{folder}' cannot be used: {link} is a symbolic link {said}"
    ):
        gk.fit(model, mlp_batches(), epochs=1, checkpoint_dir=folder, **COMMON)
    with pytest.raises(ValueError, match="point the link at an existing folder.*or pass another folder"):
        checks.check_checkpoint_dir(folder)
    assert same_weights(model, untouched) and not (tmp_path / "nowhere").exists()


# ---------------------------------------------------------------------------------------------
# A file that is not the run this gpukit can resume


def test_an_empty_checkpoint_is_named_as_empty(tmp_path):
    saved_epoch(tmp_path)
    (tmp_path / "last.pt").write_bytes(b"")
    with pytest.raises(gk.CheckpointError, match=r"last.pt: it is empty \(0 bytes\).*pass a new checkpoint_dir"):
        gk.fit(small_mlp(), mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)


@pytest.mark.parametrize("entry", ["ranks", "precision", "history"])
def test_a_checkpoint_without_an_entry_fit_saves_is_named(entry, tmp_path):
    saved_epoch(tmp_path)
    state = read_checkpoint(tmp_path / "last.pt")
    del state[entry]
    write_checkpoint(state, tmp_path / "last.pt")  # intact: a program other than fit wrote it
    with pytest.raises(gk.CheckpointError, match=rf"lacks what fit saves \({entry}\).*new checkpoint_dir.*keep it"):
        gk.fit(small_mlp(), mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)


@pytest.mark.parametrize("format_number", [3, 12])
def test_a_checkpoint_of_a_newer_gpukit_says_to_upgrade_and_keeps_it(format_number, tmp_path):
    saved_epoch(tmp_path)
    path = tmp_path / "last.pt"
    newer = path.read_bytes().replace(b"\ngpukit-checkpoint 2 ", b"\ngpukit-checkpoint %d " % format_number)
    path.write_bytes(newer)
    with pytest.raises(gk.CheckpointError) as refused:
        gk.fit(small_mlp(), mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)
    message = str(refused.value)
    assert f"a newer gpukit wrote it (checkpoint format {format_number}" in message
    assert "Upgrade gpukit" in message and "new checkpoint_dir" in message and "delete" not in message
    assert path.read_bytes() == newer


def foreign_file(kind: str, folder: Path) -> bytes:
    """A last.pt of torch.save's bytes alone, no checksum line: what each kind of writer leaves."""
    path = folder / "last.pt"
    if kind == "torch.save(model.state_dict())":
        torch.save(small_mlp().state_dict(), path)
    elif kind == "gpukit, cut before its checksum line":
        saved_epoch(folder)
        whole = path.read_bytes()
        path.write_bytes(whole[: whole.rindex(b"\ngpukit-checkpoint")])
    elif kind == "an earlier gpukit":  # format 1: torch.save of these entries, no checksum, data order or generators
        model = small_mlp()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        state = {"epoch": 1, "step": 4, "plan": {}, "model": model.state_dict(), "optimizer": optimizer.state_dict()}
        torch.save(state | {"scheduler": {}, "precision": {}, "history": {}, "rng": torch.get_rng_state()}, path)
    else:  # a training loop of one's own: a dict of other entries
        torch.save({"weights": small_mlp().state_dict(), "epoch": 3}, path)
    return path.read_bytes()


FOREIGN = {  # each kind of file: what the refusal must say (its cause and its fix), and what it must not
    "torch.save(model.state_dict())": (
        [
            "holds a model's weights alone (4 tensors, as torch.save(model.state_dict()) writes)",
            "model.load_state_dict(torch.load(path))",
            "a checkpoint_dir without this last.pt",
        ],
        "earlier gpukit",
    ),
    "gpukit, cut before its checksum line": (
        ["a gpukit save cut short exactly before its checksum line", "restore it from a complete copy"],
        "earlier gpukit",
    ),
    "an earlier gpukit": (["written by an earlier gpukit", "cannot be resumed exactly"], "cut short"),
    "a loop of one's own": (["written by torch.save, not by gpukit's fit (it holds a dict"], "earlier gpukit"),
}


@pytest.mark.parametrize("kind", FOREIGN)
def test_a_last_pt_written_elsewhere_names_its_own_cause_and_fix(kind, tmp_path):
    """Each of these was called "written by an earlier gpukit" (issue "Never silently wrong, third round")."""
    before = foreign_file(kind, tmp_path)
    said, not_said = FOREIGN[kind]
    with pytest.raises(gk.CheckpointError) as refused:
        gk.fit(small_mlp(), mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)
    message = " ".join(str(refused.value).split())
    assert message.startswith(f"cannot resume from {tmp_path / 'last.pt'}: "), message
    assert all(words in message for words in said) and not_said not in message, message
    assert (tmp_path / "last.pt").read_bytes() == before  # never deleted or overwritten


@pytest.mark.parametrize("saved_names", [True, False], ids=["names saved", "file without names"])
def test_a_resume_after_freezing_a_layer_names_the_trainable_parameters(saved_names, tmp_path):
    saved_epoch(tmp_path)
    if not saved_names:  # a file saved before the names were: the count and the frozen parameters are said
        state = read_checkpoint(tmp_path / "last.pt")
        del state["trained"]
        write_checkpoint(state, tmp_path / "last.pt")
    model = small_mlp()
    model[0].requires_grad_(False)  # the first Linear frozen since the save
    with pytest.raises(gk.CheckpointError) as refused:
        gk.fit(model, mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)
    message = str(refused.value)
    assert "set of trainable parameters changed" in message and "0.weight" in message and "0.bias" in message
    assert ("was trained, is frozen now" if saved_names else "4 parameters were trained, 2 are now") in message
    assert "requires_grad" in message and "torch.load(" in message and "new checkpoint_dir" in message
    model[0].requires_grad_(True)  # as it was: the run goes on
    with pytest.warns(UserWarning, match="going on from the finished run"):
        history = gk.fit(model, mlp_batches(), epochs=2, checkpoint_dir=tmp_path, **COMMON)
    assert history.steps[-1]["step"] == 8


def test_an_optimizer_whose_parameters_come_in_another_order_is_refused(tmp_path):
    def grouped(model: nn.Module, reverse: bool) -> torch.optim.Optimizer:
        groups = [{"params": model[0].parameters()}, {"params": model[2].parameters()}]  # 2 tensors each
        return torch.optim.SGD(groups[::-1] if reverse else groups, lr=0.1, momentum=0.9)

    model = small_mlp()
    saved_epoch(tmp_path, model, optimizer=grouped(model, reverse=False))
    model = small_mlp()
    with pytest.raises(gk.CheckpointError, match="takes the model's parameters in another order.*as it was built"):
        gk.fit(
            model, mlp_batches(), epochs=2, optimizer=grouped(model, reverse=True), checkpoint_dir=tmp_path, **COMMON
        )


def test_a_model_of_another_dtype_is_refused_naming_both(tmp_path):
    saved_epoch(tmp_path)
    model = small_mlp().double()
    data = [(inputs.double(), labels) for inputs, labels in mlp_batches()]
    with pytest.raises(gk.CheckpointError, match=r"weights are torch.float32 and this model's are torch.float64"):
        gk.fit(model, data, epochs=2, checkpoint_dir=tmp_path, **COMMON)
    assert model[0].weight.dtype == torch.float64 and same_weights(model, small_mlp().double())  # nothing loaded


class ChangesFolder(torch.utils.data.Dataset):
    """32 examples of 6 features; reading example 13 changes the working folder to `elsewhere` (as a Dataset that
    opens its files relative to its own folder by os.chdir does)."""

    def __init__(self, elsewhere: Path):
        self.elsewhere = elsewhere

    def __len__(self):
        return 32

    def __getitem__(self, index):
        if index == 13:
            os.chdir(self.elsewhere)
        return torch.randn(6, generator=torch.Generator().manual_seed(index)), index % 4


def test_a_relative_checkpoint_dir_stays_where_it_was_when_the_data_changes_the_working_folder(tmp_path, monkeypatch):
    """checkpoint_dir="run" was looked up anew at each save: after a Dataset called os.chdir, the later saves landed in
    elsewhere/run, and a resume from ./run started from an old save, with no word. TensorBoard's log_dir too."""
    monkeypatch.chdir(tmp_path)  # (and back after the test)
    (tmp_path / "elsewhere").mkdir()
    gk.fit(
        small_mlp(),
        ChangesFolder(tmp_path / "elsewhere"),
        batch_size=8,
        epochs=2,
        checkpoint_dir="run",
        save_every=1,
        log_dir="logs",
        **COMMON,
    )
    assert Path.cwd() == tmp_path / "elsewhere"  # the data did change the folder
    assert read_checkpoint(tmp_path / "run" / "last.pt")["step"] == 8  # the last save, where the first was
    assert list((tmp_path / "elsewhere").iterdir()) == []
    assert any(path.name.startswith("events.out.tfevents") for path in (tmp_path / "logs").iterdir())
