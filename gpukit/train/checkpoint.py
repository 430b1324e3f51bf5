"""Save a run and resume it exactly: `fit(saving=gk.Saving(folder, every=N))` (checkpoint_dir=, save_every=).

A checkpoint (`last.pt`) holds what the rest of the run depends on, so that a run killed anywhere and run
again with the same folder ends bit-equal to one never interrupted:

- the model, optimizer, schedule, loss scaler and History; the epoch's running sums (its row and log window);
- where the data stands: the epoch, the micro-batches read in it, and the state the epoch's order came from
  (every global generator and every generator the loader, its sampler or batch sampler hold, and the
  `state_dict()` of a sampler that has one), captured as the epoch began;
- every global generator at the save: torch's CPU one, the CUDA device's, NumPy's and Python's `random`.

A resumed epoch restores the state its order came from, reads past the batches already trained on (their
augmentation draws again, so the generators end where they were), then restores the generators of the save.

The file, with its checksum: checkpoint_file.py; the generators, the data's order, the running sums and what a resume
may change: saved_state.py; here, the Checkpointer that saves and resumes a run.
"""

from __future__ import annotations

import errno
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

from .. import distributed
from ..files import lock_folder, remove_stale_temporaries
from .batch_checks import check_finite_inputs, earlier_problem
from .checkpoint_file import CheckpointError, plain_numbers, read_checkpoint, write_checkpoint
from .checks import NonFiniteInputError, NonFiniteLossError
from .data import batches
from .saved_state import (
    _TALLY_FIELDS,
    _WINDOW_FIELDS,
    _changes,
    _check_entries,
    _check_same_model,
    _check_same_trained,
    _group_changes,
    _hyperparameters,
    _length_refusal,
    _load_sums,
    _new_schedule,
    _sums_state,
    _trained,
    global_generators,
    order_state,
    restore_global_generators,
    restore_order,
)
from .tally import callers_stacklevel

_NEW_SCHEDULE = ("lr", "schedule", "warmup")  # settings that extending a finished run may change
_LAYOUT = {  # the plan's entries that a resume must keep, as a message names them
    "batch_size": "batch_size",
    "accumulate": "accumulate",
    "world_size": "the number of processes",
    "steps_per_epoch": "the optimizer steps per epoch",
}


# ---------------------------------------------------------------------------------------------
# Saving and resuming a run


class Checkpointer:
    """Saves `last.pt` in a folder and resumes from it exactly.

    plan: how the run's optimizer steps are laid out (total_steps, steps_per_epoch, batch_size, accumulate,
    world_size); settings: the hyper-parameters that shape it (lr, optimizer, schedule, warmup, clip,
    precision, label_smoothing, seed); save_every: optimizer steps between saves within an epoch, or None.
    `run` below is fit's Run (gpukit.train.run: model, step.optimizer, scheduler, precision, history, loader,
    total_steps).
    """

    def __init__(self, directory: str | Path, plan: dict, settings: dict, *, save_every: int | None, device):
        self.path = Path(directory) / "last.pt"
        self.plan, self.settings, self.save_every, self.device = plan, plain_numbers(settings), save_every, device
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
        if not self.path.exists():
            remove_stale_temporaries(self.path)
            return 0, 0
        state = read_checkpoint(self.path)
        optimizer = run.step.optimizer
        _check_entries(state, self.path)
        _check_same_model(state["model"], run.model, self.path)
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
            # What a save within the epoch replays its order from: save_every's, and a SIGTERM's (run.save_and_stop)
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
        self._refuse_non_finite(run, epoch, position)
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
        # Another rank knows the save is written only once the barrier has passed: stopped before it (SIGTERM, Ctrl-C),
        # it names this save only if last.pt was renamed into place (holds_a_save reads the file's identity).
        self.last_good, self.in_flight = (self.in_flight[0], None) if self.in_flight else (self.last_good, None)

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

    def _refuse_non_finite(self, run, epoch: int, position: int) -> None:
        """Raise NonFiniteLossError, writing nothing, if a weight, buffer or optimizer state holds NaN or inf: the
        loss is read only every log_every steps, so a save may come first (every rank checks: same answer). Where an
        earlier batch of the epoch (`position` read, or all at its end) shows the cause, a NonFiniteInputError."""
        tensors = [value for value in run.model.state_dict().values() if torch.is_tensor(value)]
        for state in run.step.optimizer.state.values():
            tensors += [value for value in state.values() if torch.is_tensor(value)]
        tensors = [tensor for tensor in tensors if tensor.is_floating_point() or tensor.is_complex()]
        if not tensors or torch.stack([tensor.isfinite().all() for tensor in tensors]).all():  # one synchronisation
            return
        last, trained = self.last_good_save(), epoch + (position > 0)  # (the epoch trained, from 1: an end's is before)
        earlier = partial(earlier_problem, run, trained - 1, None, position or None, "weights")
        try:
            check_finite_inputs(None, run.step_index, epoch, run.loss.ignore_index, earlier)
        except NonFiniteInputError as error:
            error.add_note(f"They were not saved: {last}.")
            raise
        raise NonFiniteLossError(
            f"the weights or the optimizer's state hold NaN or inf after optimizer step {run.step_index} (epoch "
            f"{trained}), so they were not saved: {last}. Try a lower lr, more warm-up, gradient "
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
