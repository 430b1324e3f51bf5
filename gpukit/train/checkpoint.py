"""Save a run and resume it exactly: `fit(checkpoint_dir=..., save_every=N)`.

A checkpoint (`last.pt`) holds what the rest of the run depends on, so that a run killed anywhere and run
again with the same folder ends bit-equal to one never interrupted:

- the model, optimizer, schedule, loss scaler and History; the epoch's running sums (its row and log window);
- where the data stands: the epoch, the micro-batches read in it, and the state the epoch's order came from
  (every global generator and every generator the loader, its sampler or batch sampler hold, and the
  `state_dict()` of a sampler that has one), captured as the epoch began;
- every global generator at the save: torch's CPU one, the CUDA device's, NumPy's and Python's `random`.

A resumed epoch restores the state its order came from, reads past the batches already trained on (their
augmentation draws again, so the generators end where they were), then restores the generators of the save.

The file is what `torch.save` writes, then one line with the SHA-256 and length of those bytes, checked before
`torch.load`: a damaged or truncated file is a CheckpointError naming it, never garbage weights. `torch.load`
reads the file as it is, so the weights stay readable without gpukit.
"""

from __future__ import annotations

import errno
import hashlib
import io
import numbers
import pickle
import random
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset

from .. import distributed
from ..files import lock_folder, remove_stale_temporaries, write_atomic
from .checks import NonFiniteLossError
from .data import batches
from .tally import callers_stacklevel

FORMAT = 2  # 1: gpukit's earlier files (torch.save's bytes alone: no checksum, data order or generators)
# Keys a schedule writes into the optimizer's groups: the rest (weight_decay, momentum, betas, ...) shape the run.
# ("step": timm's LAMB counts its steps in each group.)
_SCHEDULE_KEYS = ("params", "lr", "initial_lr", "max_lr", "min_lr", "base_momentum", "max_momentum", "step")
_NEW_SCHEDULE = ("lr", "schedule", "warmup")  # settings that extending a finished run may change
_LAYOUT = {  # the plan's entries that a resume must keep, as a message names them
    "batch_size": "batch_size",
    "accumulate": "accumulate",
    "world_size": "the number of processes",
    "steps_per_epoch": "the optimizer steps per epoch",
}


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed (damaged, truncated, or not the run this call describes), or cannot be saved
    (a full or read-only disk): the message names the cause, what to do, and the save kept."""


# ---------------------------------------------------------------------------------------------
# The file: torch.save's bytes, then a line with their checksum


def _trailer(digest: bytes, size: int) -> bytes:
    return b"\ngpukit-checkpoint %d sha256=%s bytes=%016d\n" % (FORMAT, digest.hex().encode(), size)


_TRAILER = re.compile(rb"\ngpukit-checkpoint (\d+) sha256=([0-9a-f]{64}) bytes=(\d{16})\n\Z")
_TRAILER_LENGTH = len(_trailer(bytes(32), 0))
_END_OF_ZIP = b"PK\x05\x06"  # how the bytes of torch.save end (the zip's last record, 22 bytes, no comment)


class _Hashing:
    """A write-only file that hashes and counts what passes through it (torch.save needs write and flush)."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None  # a failed write (a full disk), which torch may re-raise as a RuntimeError

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def write_checkpoint(state: dict, path: Path) -> None:
    """torch.save `state` to `path`, then a line with the SHA-256 and length of its bytes; atomically.

    torch.load reads such a file as it is (a zip archive may be followed by other bytes), so the weights
    stay readable without gpukit; read_checkpoint checks the line first.
    """

    def write(file) -> None:
        hashing = _Hashing(file)
        try:
            torch.save(state, hashing)
        except RuntimeError as error:
            if isinstance(error.__context__, KeyboardInterrupt):  # Ctrl-C while torch's C++ writer called write()
                raise error.__context__ from None  # as Ctrl-C, not torch's "unexpected pos" RuntimeError
            if hashing.error is None:
                raise
            raise hashing.error from None  # the disk's own error (ENOSPC, EROFS), not torch's "unexpected pos"
        file.write(_trailer(hashing.sha256.digest(), hashing.size))

    remove_stale_temporaries(path)
    write_atomic(path, write)


def read_checkpoint(path: Path) -> dict:
    """The state in `path`, its checksum verified first; any fault is a CheckpointError that names the file."""
    remove_stale_temporaries(path)  # a save killed mid-write left them; they are never read
    where = f"cannot resume from {path}"
    if Path(path).is_dir():
        raise CheckpointError(
            f"{where}: it is a folder, where gpukit saves the run as a file of that name; move or rename the folder "
            "(gpukit never deletes it), or pass another checkpoint_dir."
        )
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{where}: {error}.") from error
    afresh = "delete it (or pass a new checkpoint_dir) to start afresh, or restore it from a copy"
    if not data:
        raise CheckpointError(
            f"{where}: it is empty (0 bytes): something other than gpukit's saves, which never leave a partial file, "
            f"cut it short (a copy, a full disk); {afresh}."
        )
    match = _TRAILER.search(data, max(0, len(data) - _TRAILER_LENGTH - 8))  # (a format number of up to 9 digits)
    if match is None and data[-22:].startswith(_END_OF_ZIP):
        raise CheckpointError(f"{where}: {_without_checksum(data)}")
    if match is None:
        raise CheckpointError(
            f"{where}: it is truncated, or no gpukit checkpoint: its {len(data):,} bytes do not end with the "
            f"checksum line gpukit writes last; {afresh}."
        )
    size, payload = int(match[3]), memoryview(data)[: match.start()]
    if int(match[1]) > FORMAT:
        raise CheckpointError(
            f"{where}: a newer gpukit wrote it (checkpoint format {int(match[1])}; this gpukit reads up to {FORMAT}). "
            "Upgrade gpukit to the version that wrote it (or a later one) to resume it, or pass a new checkpoint_dir "
            "to start afresh and keep this file as it is."
        )
    if int(match[1]) != FORMAT:
        raise CheckpointError(f"{where}: it is in format {int(match[1])}, this gpukit reads {FORMAT}; {afresh}.")
    if size != len(payload) or hashlib.sha256(payload).hexdigest() != match[2].decode():
        raise CheckpointError(
            f"{where}: it is damaged: its bytes no longer match the SHA-256 and length saved with them (the disk or "
            f"a copy changed them); {afresh}."
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # it reads up to the line
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as error:
        raise CheckpointError(f"{where}: it is intact but torch.load cannot read it ({error}); {afresh}.") from error


def _plain(settings: dict) -> dict:
    """Settings with NumPy's numbers as Python's (seed=np.int64(3), lr=np.float64(0.1)): torch.load(weights_only=True)
    refuses NumPy scalars, so a save holding one could not be resumed."""
    plain = {}
    for name, value in settings.items():
        if type(value) not in (bool, int, float) and isinstance(value, numbers.Integral):  # (np.bool_ is no Integral)
            value = int(value)
        elif type(value) not in (bool, int, float) and isinstance(value, numbers.Real):  # np.float64 is a float too
            value = float(value)
        plain[name] = value
    return plain


def _without_checksum(data: bytes) -> str:
    """Why a file of torch.save's bytes alone (no checksum line) cannot be resumed, told by what it holds: gpukit's
    own save cut short exactly before its checksum line, an earlier gpukit's save, a model's state_dict that
    torch.save wrote, or something else. torch.load(weights_only=True) reads it: no code in it runs."""
    move = "move it out of the folder (or pass a new checkpoint_dir) to start afresh"
    try:
        state = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError, AttributeError, ValueError):
        return f"it is no gpukit checkpoint: a torch.save file that torch.load(weights_only=True) refuses; {move}."
    if isinstance(state, dict) and {"ranks", "position", "settings"} <= state.keys():
        return (
            "it is a gpukit save cut short exactly before its checksum line (a copy or transfer that stopped early, a "
            "tool that rewrote it), so its bytes cannot be verified; restore it from a complete copy, or move it out "
            "of the folder (or pass a new checkpoint_dir) to start afresh."
        )
    if isinstance(state, dict) and {"model", "optimizer", "rng"} <= state.keys():
        return (
            "it was written by an earlier gpukit, without a checksum or the data's order, and cannot be resumed "
            "exactly (torch.load still reads its weights, state['model']); move it out of the folder (or pass a "
            "new checkpoint_dir) to start afresh."
        )
    if isinstance(state, dict) and state and all(isinstance(value, torch.Tensor) for value in state.values()):
        return (
            f"it holds a model's weights alone ({len(state)} tensors, as torch.save(model.state_dict()) writes), not "
            "a run fit can resume (no optimizer, schedule or data order). To start from those weights, load them "
            "(model.load_state_dict(torch.load(path))) and pass a checkpoint_dir without this last.pt; to resume a "
            "run, pass the folder where fit saved it."
        )
    return (
        f"it was written by torch.save, not by gpukit's fit (it holds a {type(state).__name__}, not a run fit can "
        f"resume); {move}."
    )


# ---------------------------------------------------------------------------------------------
# Generators: the global ones, and those a loader holds


def _save_generator(generator) -> tuple | None:
    if isinstance(generator, torch.Generator):
        return ("torch", generator.get_state())
    if isinstance(generator, np.random.Generator):
        return ("numpy", generator.bit_generator.state)
    if isinstance(generator, np.random.RandomState):
        name, keys, position, has_gauss, gauss = generator.get_state()
        return ("numpy-legacy", (name, keys.tolist(), position, has_gauss, gauss))
    if isinstance(generator, random.Random):
        return ("python", generator.getstate())
    return None


def _load_generator(generator, saved: tuple) -> None:
    kind, state = saved
    if kind == "torch":
        generator.set_state(state)
    elif kind == "numpy":
        generator.bit_generator.state = state
    elif kind == "numpy-legacy":
        name, keys, position, has_gauss, gauss = state
        generator.set_state((name, np.array(keys, dtype=np.uint32), position, has_gauss, gauss))
    else:
        generator.setstate(state)


def global_generators(device: torch.device) -> dict:
    """Every global generator's state: torch's CPU one, the CUDA device's (on CUDA), NumPy's and Python's."""
    state = {
        "torch": torch.get_rng_state(),
        "numpy": _save_generator(np.random.mtrand._rand),
        "python": random.getstate(),
    }
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_global_generators(state: dict, device: torch.device) -> None:
    torch.set_rng_state(state["torch"])
    _load_generator(np.random.mtrand._rand, state["numpy"])
    random.setstate(state["python"])
    if device.type == "cuda" and "cuda" in state:
        torch.cuda.set_rng_state(state["cuda"], device)


def _order_parts(loader) -> dict[str, object]:
    """What decides the order of `loader`'s batches, by role."""
    if not isinstance(loader, DataLoader):
        return {"data": loader}
    parts = {"loader": loader, "sampler": loader.sampler, "batch_sampler": loader.batch_sampler}
    parts["batch_sampler.sampler"] = getattr(loader.batch_sampler, "sampler", None)
    if isinstance(loader.dataset, IterableDataset):
        parts["dataset"] = loader.dataset
    return {role: part for role, part in parts.items() if part is not None}


def _stateful(part) -> bool:
    return callable(getattr(part, "state_dict", None)) and callable(getattr(part, "load_state_dict", None))


def order_state(loader) -> dict:
    """The state `loader`'s next epoch draws its order from: its parts' generators and state_dicts."""
    state = {}
    for role, part in _order_parts(loader).items():
        attributes = getattr(part, "__dict__", {})
        saved = {name: _save_generator(value) for name, value in attributes.items()}
        state[role] = {"generators": {name: value for name, value in saved.items() if value is not None}}
        if _stateful(part) and not isinstance(part, DataLoader):
            state[role]["state_dict"] = part.state_dict()
    return state


def restore_order(loader, state: dict) -> None:
    for role, part in _order_parts(loader).items():
        saved = state.get(role, {})
        if "state_dict" in saved:
            part.load_state_dict(saved["state_dict"])
        for name, generator in saved.get("generators", {}).items():
            _load_generator(getattr(part, name), generator)


def _replayable(part) -> bool:
    module = type(part).__module__
    return (
        isinstance(part, (list, tuple))
        or module.startswith(("torch.utils.data", "gpukit."))
        or (_stateful(part) and not isinstance(part, DataLoader))
    )


def warn_if_order_cannot_be_saved(loader) -> None:
    """A warning, before any work, where a resumed run may not see the batches an uninterrupted one would."""
    problems = [
        f"its {role} is a {type(part).__name__} without state_dict()/load_state_dict()"
        for role, part in _order_parts(loader).items()
        if not _replayable(part)
    ]
    if isinstance(loader, DataLoader) and loader.num_workers > 0 and loader.persistent_workers:
        problems.append("persistent_workers=True keeps each worker's random state from epoch to epoch")
    if problems:
        warnings.warn(
            f"checkpoint_dir: fit cannot save the exact place of the {type(loader).__name__} passed as train_data "
            f"({'; '.join(problems)}). A resumed run replays the epoch from the global generators and the generators "
            "among its attributes, which is exact only if it draws from nothing else. For an exact resume pass the "
            "Dataset and batch_size, or a DataLoader with a torch.utils.data sampler (generator=torch.Generator()) "
            "and persistent_workers=False.",
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )


# ---------------------------------------------------------------------------------------------
# Running sums (fit's Tally and log window), which stay on the device between saves


def _sums_state(holder, names: tuple[str, ...]) -> dict:
    values = {name: value.cpu() for name, value in holder.sums.values.items()}  # one synchronisation, at a save
    return {"values": values} | {name: getattr(holder, name) for name in names}


def _load_sums(holder, state: dict, device: torch.device) -> None:
    holder.sums.values = {name: value.to(device) for name, value in state["values"].items()}
    for name, value in state.items():
        if name != "values":
            setattr(holder, name, value)


_TALLY_FIELDS = ("samples", "accuracy", "sequences")
_WINDOW_FIELDS = ("sequences", "micro_batches", "samples", "steps", "lrs")


# ---------------------------------------------------------------------------------------------
# What a resume may change


def _hyperparameters(optimizer: torch.optim.Optimizer) -> list[dict]:
    """Each parameter group's settings that no schedule changes (weight_decay, momentum, betas, ...)."""
    plain = (int, float, str, bool, tuple, type(None))
    return [
        {key: value if isinstance(value, plain) else repr(value) for key, value in group.items()}
        for group in ({k: v for k, v in g.items() if k not in _SCHEDULE_KEYS} for g in optimizer.param_groups)
    ]


def _changes(saved: dict, now: dict, names) -> list[str]:
    return [f"{name} ({saved.get(name)!r} → {now.get(name)!r})" for name in names if saved.get(name) != now.get(name)]


def _group_changes(saved: list[dict], now: list[dict]) -> list[str]:
    if len(saved) != len(now):
        return [f"the optimizer's parameter groups ({len(saved)} → {len(now)})"]
    changes = {}  # by key: a changed weight_decay is said once, not once per group
    for before, after in zip(saved, now):
        for key in sorted(before.keys() | after.keys()):
            if key not in changes and before.get(key) != after.get(key):
                changes[key] = f"{key} ({before.get(key)!r} → {after.get(key)!r})"
    return list(changes.values())


def _shape(value) -> tuple:
    return tuple(getattr(value, "shape", ()))  # a module's extra state need not be a tensor


def _check_same_model(saved: dict, model: dict, path: Path) -> None:
    """Refuse, before a tensor is copied, weights whose names, shapes or dtypes differ from the model's."""
    differences = [f"{name} is not in the file" for name in model.keys() - saved.keys()]
    differences += [f"{name} is not in this model" for name in saved.keys() - model.keys()]
    differences += [
        f"{name} is {_shape(saved[name])} there, {_shape(tensor)} here"
        for name, tensor in model.items()
        if name in saved and _shape(saved[name]) != _shape(tensor)
    ]
    if differences:
        raise CheckpointError(
            f"cannot resume from {path}: it holds another model's weights ({'; '.join(sorted(differences)[:3])}"
            f"{'; ...' if len(differences) > 3 else ''}); pass the model it was trained with, or a new checkpoint_dir."
        )
    dtypes = {  # load_state_dict would cast them without a word: the run would not go on as saved
        name: (saved[name].dtype, tensor.dtype)
        for name, tensor in model.items()
        if torch.is_tensor(tensor) and torch.is_tensor(saved[name]) and saved[name].dtype != tensor.dtype
    }
    if dtypes:
        name, (there, here) = next(iter(dtypes.items()))
        raise CheckpointError(
            f"cannot resume from {path}: its weights are {there} and this model's are {here} ({name}, and "
            f"{len(dtypes) - 1} more); convert the model back (model.to({there})) to resume the run saved there, or "
            "pass a new checkpoint_dir."
        )


_ENTRIES = ("epoch", "step", "position", "plan", "settings", "optimizer_groups", "schedule_start", "model")
_ENTRIES += ("optimizer", "scheduler", "precision", "history", "ranks")  # what fit saves, all read on resume


def _check_entries(state, path: Path) -> None:
    missing = [name for name in _ENTRIES if name not in state] if isinstance(state, dict) else list(_ENTRIES)
    if missing:
        raise CheckpointError(
            f"cannot resume from {path}: it is intact but lacks what fit saves ({', '.join(missing)}), so another "
            "program wrote it (gk.fit's saves hold them all); pass a new checkpoint_dir to start afresh and keep it, "
            "or load what it holds with torch.load."
        )


def _trained(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[str]:
    """The names of the parameters `optimizer` updates, in its order (what its saved state is indexed by)."""
    names = {id(parameter): name for name, parameter in model.named_parameters()}
    return [names.get(id(parameter), "?") for group in optimizer.param_groups for parameter in group["params"]]


def _check_same_trained(state: dict, model: torch.nn.Module, optimizer, path: Path) -> None:
    """Refuse a resume after parameters were frozen or unfrozen (requires_grad) since the save, naming them."""
    now = _trained(model, optimizer)
    saved = state.get("trained")  # (not in the files of before it was saved: then torch's optimizers' count tells)
    saved_groups = state["optimizer"].get("param_groups", [{"params": now}])  # (gpukit's Muon saves two optimizers)
    saved_count = sum(len(group["params"]) for group in saved_groups)
    if (set(saved) == set(now)) if saved is not None else len(now) == saved_count:
        return  # (the same set in another order: another optimizer's groups, which _check names)
    frozen = [name for name, parameter in model.named_parameters() if not parameter.requires_grad]
    if saved is not None:
        dropped = [name for name in saved if name not in now]
        changes = [f"{name} was trained, is {'frozen' if name in frozen else 'left out'} now" for name in dropped]
        changes += [f"{name} is trained now, was not" for name in now if name not in saved]
    else:
        changes = [f"{saved_count} parameters were trained, {len(now)} are now"] + [
            f"{name} is frozen" for name in frozen
        ]
    raise CheckpointError(
        f"cannot resume from {path}: the set of trainable parameters changed since the save ({'; '.join(changes[:4])}"
        f"{'; ...' if len(changes) > 4 else ''}): a layer frozen or unfrozen (requires_grad), so the saved optimizer "
        "state fits other parameters. Set requires_grad as it was to resume that run; or, to train the new set from "
        f"its weights, model.load_state_dict(torch.load({str(path)!r})['model']) and pass a new checkpoint_dir."
    )


def _length_refusal(step: int, saved_total: int | None, total: int | None) -> str:
    if saved_total is not None and step >= saved_total:
        return (
            f"the run saved there is finished after {step} optimizer steps, more than the {total} this call plans; "
            f"pass epochs (or max_steps) that reach past step {step} to train on, or a new checkpoint_dir."
        )
    return (
        f"the run saved there stopped at optimizer step {step} of the {saved_total or 'unbounded'} it planned, and this "
        f"call plans {total or 'no end'} (epochs or max_steps changed). Its schedule spans the planned steps and cannot "
        "be stretched exactly: finish it with the epochs and max_steps it began with, then call again with more epochs "
        "to go on with a new schedule; or pass a new checkpoint_dir."
    )


def _new_schedule(optimizer, peaks: list[float], build_schedule: Callable, steps: int | None):
    """A fresh schedule from each group's peak lr over `steps` (what extending a finished run trains on)."""
    for group, peak in zip(optimizer.param_groups, peaks):
        for key in ("initial_lr", "max_lr", "min_lr"):
            group.pop(key, None)  # the previous schedule's: a new one sets its own
        group["lr"] = peak
    return build_schedule(optimizer, total_steps=steps)


# ---------------------------------------------------------------------------------------------
# Saving and resuming a run


class Checkpointer:
    """Saves `last.pt` in a folder and resumes from it exactly.

    plan: how the run's optimizer steps are laid out (total_steps, steps_per_epoch, batch_size, accumulate,
    world_size); settings: the hyper-parameters that shape it (lr, optimizer, schedule, warmup, clip,
    precision, label_smoothing, seed); save_every: optimizer steps between saves within an epoch, or None.
    `run` below is fit's _Run (model, step.optimizer, scheduler, precision, history, loader, total_steps).
    """

    def __init__(self, directory: str | Path, plan: dict, settings: dict, *, save_every: int | None, device):
        self.path = Path(directory) / "last.pt"
        self.plan, self.settings, self.save_every, self.device = plan, _plain(settings), save_every, device
        self.schedule_start = 0  # the step the schedule began at: 0, or where a finished run was extended
        self.pending = None  # the saved place in the data, until the first epoch trained resumes from it
        self.epoch_start = None  # the state the current epoch's order came from (for saves within it)
        self.writer = None  # a BackgroundWriter (fit's save_in_background=True), else saves block until written
        self.last_good = None  # (epoch counted from 1, optimizer step) of the save last.pt holds, if any
        self.kept_if_in_flight_fails = None  # last_good before the save being written in the background
        self.release = None  # lets the folder go (lock_folder), once this run holds it
        self.in_flight = None  # (last_good of the save being written, last.pt's identity before it) during a save

    def hold(self) -> None:
        """Take the folder for this run, or raise FolderInUseError if another live process trains in it: two runs
        in one folder would overwrite each other's saves. The first rank holds it for the job; a killed run's hold
        ends with its process."""
        if distributed.is_main():
            self.release = lock_folder(self.path.parent, "checkpoint_dir")

    def let_go(self) -> None:
        """Wait for a save in flight, then let the folder go (fit calls it however it ends)."""
        try:
            self.wait_for_writer()
        finally:
            release, self.release = self.release, None
            if release is not None:
                release()

    def resume(self, run, build_schedule: Callable) -> tuple[int, int]:
        """Load the saved run into `run`: (epoch, optimizer step) to go on from; (0, 0) without a checkpoint.

        build_schedule(optimizer, total_steps=n) makes this call's schedule over n steps.
        """
        if distributed.is_sharded(run.model):
            raise ValueError(
                "checkpoint_dir does not support FSDP2-sharded models; save those with torch.distributed.checkpoint."
            )
        if not self.path.exists():
            remove_stale_temporaries(self.path)
            return 0, 0
        state = read_checkpoint(self.path)
        optimizer = run.step.optimizer
        _check_entries(state, self.path)
        _check_same_model(state["model"], run.model.state_dict(), self.path)
        _check_same_trained(state, run.model, optimizer, self.path)
        extend = self._check(state, optimizer)
        trained = _trained(run.model, optimizer)
        if state.get("trained", trained) != trained:  # (the same set, _check_same_trained made sure; _check the groups)
            raise CheckpointError(
                f"cannot resume from {self.path}: the optimizer takes the model's parameters in another order than "
                "at the save, so its saved state would go to the wrong ones; build it as it was built for the run "
                "saved there (the same parameters and groups, in the same order), or pass a new checkpoint_dir."
            )
        peaks = [group.get("max_lr", group.get("initial_lr", group["lr"])) for group in optimizer.param_groups]
        self.schedule_start = state["step"] if extend else state["schedule_start"]
        remaining = None if run.total_steps is None else run.total_steps - self.schedule_start
        if self.schedule_start and not extend:  # an extended run: its schedule spans the steps after the extension
            run.scheduler = _new_schedule(optimizer, peaks, build_schedule, remaining)
        try:
            run.model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
        except (RuntimeError, ValueError, KeyError) as error:
            raise CheckpointError(
                f"cannot resume from {self.path}: its optimizer state does not fit this optimizer ({error}); pass the "
                "optimizer it was trained with, or a new checkpoint_dir to start afresh."
            ) from error
        if extend:
            run.scheduler = _new_schedule(optimizer, peaks, build_schedule, remaining)
            self._say_extended(state["step"], run.total_steps)
        else:
            run.scheduler.load_state_dict(state["scheduler"])
        run.precision.load_state_dict(state["precision"])
        for name, value in state["history"].items():  # "batch_size" in files of before the rename: the global one
            setattr(run.history, "global_batch_size" if name == "batch_size" else name, value)
        self.pending = {"position": state["position"]} | state["ranks"][distributed.rank()]
        self.last_good = (state["epoch"] + (state["position"] > 0), state["step"])
        return state["epoch"], state["step"]

    def _check(self, state: dict, optimizer) -> bool:
        """Whether this call extends the finished run saved; raises where it cannot resume that run exactly."""
        where = f"cannot resume from {self.path}"
        moved = [
            f"{label} ({state['plan'].get(name)!r} → {self.plan[name]!r})"
            for name, label in _LAYOUT.items()
            if state["plan"].get(name) != self.plan[name]
        ]
        if moved:
            raise CheckpointError(
                f"{where}: this call changes {', '.join(moved)} of the run saved there; resume with the same data, "
                "batch_size, accumulate and number of processes, or pass a new checkpoint_dir."
            )
        step, saved_total, total = state["step"], state["plan"]["total_steps"], self.plan["total_steps"]
        extend = saved_total is not None and step >= saved_total and (total is None or total > step)
        if total != saved_total and not extend:
            raise CheckpointError(f"{where}: {_length_refusal(step, saved_total, total)}")
        fixed = [name for name in self.settings if not (extend and name in _NEW_SCHEDULE)]
        changed = _changes(state["settings"], self.settings, fixed)
        changed += _group_changes(state["optimizer_groups"], _hyperparameters(optimizer))
        if changed:
            raise CheckpointError(
                f"{where}: this call changes {', '.join(changed)}, which shape the run saved there; pass the saved "
                "values to resume it exactly, or a new checkpoint_dir to start afresh."
            )
        return extend

    def _say_extended(self, step: int, total: int | None) -> None:
        settings = self.settings
        warnings.warn(
            f"checkpoint_dir: going on from the finished run in {self.path} (optimizer step {step}) to step "
            f"{total or 'no end'}: the weights and the optimizer's state carry on, and a new {settings['schedule']!r} "
            f"schedule (peak lr {settings['lr']:g}, warmup {settings['warmup']:g}) spans the added steps.",
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )

    def start_epoch(self, run, tally, window) -> tuple:
        """(this epoch's batches, micro-batches of it already trained on): after a resume, the epoch's order
        replayed from its saved start and read past the batches the saved run had trained on."""
        pending, self.pending = self.pending, None
        if pending is None:
            if self.save_every:
                self.epoch_start = {"generators": global_generators(self.device), "order": order_state(run.loader)}
            return batches(run.loader, run.device, check=run.target_check()), 0
        self.epoch_start = pending["start"]
        restore_global_generators(pending["start"]["generators"], self.device)
        restore_order(run.loader, pending["start"]["order"])
        iterator = iter(run.loader)
        for _ in range(pending["position"]):
            if next(iterator, None) is None:
                raise CheckpointError(
                    f"cannot resume from {self.path}: the data now ends before the {pending['position']} batches the "
                    "saved run had read in this epoch; resume with the same data, or pass a new checkpoint_dir."
                )
        if pending["position"]:  # (at an epoch's start they are the start's: iter() may have drawn since)
            restore_global_generators(pending["generators"], self.device)
        if pending["tally"] is not None:
            _load_sums(tally, pending["tally"], run.device)
            _load_sums(window, pending["window"], run.device)
        return batches(run.loader, run.device, iterator, run.target_check(), pending["position"]), pending["position"]

    def save(self, run, epoch: int, position: int = 0, tally=None, window=None) -> None:
        """Save `run` after `position` micro-batches of epoch `epoch` (counted from 0); every rank calls it. A state
        that is not finite is never written over the last good save: a NonFiniteLossError names that save."""
        self._refuse_non_finite(run, epoch + (position > 0))
        # What this save will be, and last.pt's inode before it: a save interrupted after its rename is known by that
        self.in_flight = (epoch + (position > 0), run.step_index), _identity(self.path)
        ranks = _every_rank(self._this_rank(run, position, tally, window))
        if distributed.is_main():  # one writer: the model and optimizer are the same on every rank
            history = run.history
            state = {
                "epoch": epoch,
                "step": run.step_index,
                "position": position,
                "plan": self.plan,
                "settings": self.settings,
                "optimizer_groups": _hyperparameters(run.step.optimizer),
                "trained": _trained(run.model, run.step.optimizer),
                "schedule_start": self.schedule_start,
                "model": run.model.state_dict(),
                "optimizer": run.step.optimizer.state_dict(),
                "scheduler": run.scheduler.state_dict(),
                "precision": run.precision.state_dict(),
                "history": {name: getattr(history, name) for name in _HISTORY_FIELDS},
                "ranks": ranks,
            }
            self._write(state)
        self.last_good, self.in_flight = self.in_flight[0], None
        distributed.barrier()  # no rank runs ahead of a checkpoint that is not yet complete

    def _write(self, state: dict) -> None:
        """Write `state` over last.pt: now, or in the background (save_in_background), where a write that failed is
        raised at the next save or at the end. Either way an OSError becomes a CheckpointError naming the save kept."""
        if self.writer is None:
            try:
                write_checkpoint(state, self.path)
            except OSError as error:
                raise self._save_failed(error) from error
        else:
            self.wait_for_writer()  # (the writer waits too; here its error is said with the save it left)
            self.writer.save(state, self.path)
            self.kept_if_in_flight_fails = self.last_good

    def wait_for_writer(self) -> None:
        """Block until a save in the background is on disk; raise a CheckpointError if it failed on the disk."""
        if self.writer is None:
            return
        try:
            self.writer.wait()
        except RuntimeError as error:
            if not isinstance(error.__cause__, OSError):
                raise
            self.last_good = self.kept_if_in_flight_fails  # last.pt holds the save before the one that failed
            raise self._save_failed(error.__cause__) from error.__cause__

    def _save_failed(self, error: OSError) -> CheckpointError:
        """The error a save that the disk refused is: its cause, the save last.pt keeps, and what to do."""
        cause, fix = _SAVE_FAILURES.get(error.errno, (f"the write failed ({error})", "fix that"))
        kept, again = f"{self.last_good_save()}, untouched", "resume from that save"
        if self.last_good is None:
            kept, again = "nothing was saved there before", "start the run again"
        return CheckpointError(
            f"cannot save the run in {self.path.parent}: {cause}; {kept}. To go on, {fix} (or copy the folder to "
            f"another disk), then call fit again with that folder as checkpoint_dir to {again}."
        )

    def holds_a_save(self) -> bool:
        """Whether last.pt holds a save of this run, or of the run it resumed (a save stopped after its rename too)."""
        if self.in_flight is not None and self.writer is None and _identity(self.path) != self.in_flight[1]:
            self.last_good, self.in_flight = self.in_flight[0], None  # renamed into place, then interrupted
        return self.last_good is not None

    def last_good_save(self) -> str:
        """Where the last save that holds a finite state is, said for an error message."""
        if not self.holds_a_save():
            return f"nothing was saved there before, so {self.path} does not exist"
        epoch, step = self.last_good
        return f"{self.path} keeps the last good save: optimizer step {step} (epoch {epoch})"

    def _refuse_non_finite(self, run, epoch: int) -> None:
        """Raise NonFiniteLossError, writing nothing, if a weight, buffer or optimizer state holds NaN or inf: the
        loss is read only every log_every steps, so a save may come first (every rank checks: same answer)."""
        tensors = [value for value in run.model.state_dict().values() if torch.is_tensor(value)]
        for state in run.step.optimizer.state.values():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
        tensors = [tensor for tensor in tensors if tensor.is_floating_point() or tensor.is_complex()]
        if not tensors or torch.stack([tensor.isfinite().all() for tensor in tensors]).all():  # one synchronisation
            return
        raise NonFiniteLossError(
            f"the weights or the optimizer's state hold NaN or inf after optimizer step {run.step_index} (epoch "
            f"{epoch}), so they were not saved: {self.last_good_save()}. Try a lower lr, more warm-up, gradient "
            "clipping (clip=1.0), or bf16-mixed instead of fp16-mixed; the same checkpoint_dir resumes from that save."
        )

    def _this_rank(self, run, position: int, tally, window) -> dict:
        """What differs between the ranks of a job: the generators, the data order's start and the running sums."""
        start = self.epoch_start
        if position == 0:  # the next epoch starts from here
            start = {"generators": global_generators(self.device), "order": order_state(run.loader)}
        return {
            "start": start,
            "generators": global_generators(self.device),
            "tally": None if tally is None else _sums_state(tally, _TALLY_FIELDS),
            "window": None if window is None else _sums_state(window, _WINDOW_FIELDS),
        }


def _identity(path: Path) -> tuple | None:
    """Which file `path` is (inode, change time in ns), or None: a save's rename puts another file there."""
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_ino, status.st_ctime_ns


_SAVE_FAILURES = {  # errno: (what the disk said, what to do about it)
    errno.ENOSPC: ("the disk is full (no space left on device)", "free space on that disk"),
    getattr(errno, "EDQUOT", None): ("your disk quota is used up", "free space within your quota"),  # (not on Windows)
    errno.EROFS: ("the filesystem is read-only (a disk error can turn it so: see dmesg)", "remount it writable"),
    errno.EACCES: ("permission was denied", "make the folder writable for this user"),
    errno.EIO: ("the disk reported an input/output error", "check the disk (dmesg)"),
}


def _every_rank(value) -> list:
    """`value` of every rank, in rank order (one all-gather in a distributed job; else a list of one)."""
    if distributed.world_size() == 1:
        return [value]
    gathered = [None] * distributed.world_size()
    torch.distributed.all_gather_object(gathered, value)
    return gathered


_HISTORY_FIELDS = ("steps", "epochs", "seconds", "micro_batch_size", "global_batch_size", "sample_name")
