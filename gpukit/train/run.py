"""The run's lifecycle: what fit built (`Run`) and what happens to it around the steps, so that the loop reads as
its algorithm. Before the first step: resuming from the last save and starting the reports; at the first batch, what a
sample is; each epoch's start (the order, replayed after a resume) and end; saving; and however fit ends, an interrupt
said with how far training got (the model put back where nothing was saved yet), an out-of-memory error raised only
once what the run held is freed, the folder let go and the model given back as it came.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial, wraps

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .. import distributed
from ..data.loaders import worker_crash
from ..hardware.monitor import Monitor
from ..memory.allocator import free_memory, out_of_memory_error, watch_out_of_memory
from ..precision import Precision
from ..preemption import StopRequest
from ..step import Batch, Loss, TrainStep
from ..widgets import Progress
from .batch_checks import check_host_targets
from .checkpoint import Checkpointer
from .checks import check_first_batch
from .data import batches
from .history import History
from .log_window import LogWindow
from .model_options import ModelOptions
from .options import Reporting, Saving
from .saved_state import order_state, torch_generators, warn_if_order_cannot_be_saved
from .tally import Tally, callers_stacklevel
from .tensorboard_log import open_log


def noted_if_interrupted_before_training(fit_function: Callable) -> Callable:
    """Ctrl-C during fit's checks and setup (eval_data's first batch through the model, a compile, a resume's read)
    gets a note as an interrupted training does: nothing was trained or saved."""

    @wraps(fit_function)
    def noted(*args, **kwargs):
        try:
            return fit_function(*args, **kwargs)
        except KeyboardInterrupt as stopped:
            if not getattr(stopped, "noted_by_fit", False):  # (_train's handler said how far training got)
                stopped.add_note(
                    "fit was interrupted before training started: no optimizer step was taken and nothing was saved; "
                    "the weights are as they came (or, with a checkpoint_dir, as its last save)."
                )
            raise

    return noted


@dataclass(eq=False)
class Run:
    """What fit built before the first step, and what it updates as it trains."""

    model: nn.Module
    device: torch.device
    precision: Precision
    loss: Loss
    metrics: dict
    loader: object
    parallel: nn.Module  # what the step calls: the model, or its DDP wrapper
    step: TrainStep
    scheduler: object
    peak_lr: float
    steps_per_epoch: int | None
    total_steps: int | None
    log_every: int
    channels_last: bool
    eval_data: object
    eval_loss: Loss
    history: History
    hold_predictions: bool = False  # the epoch's accuracy counted every 32 batches (tally.predictions_can_wait)
    checkpoint: Checkpointer | None = None
    save_every: int | None = None  # optimizer steps between saves within an epoch
    board: object = None  # the TensorBoard log (one that writes nothing when off)
    bar: Progress | None = None
    watcher: Monitor | None = None
    micro_batch_size: int | None = None  # samples per micro-batch: the loader's, else read from the first batch
    seen_a_batch: bool = False
    seen_outputs: bool = False  # whether the model's outputs were looked at once (warn_if_scalars_ignored)
    shifted_labels: bool | None = None  # tokens counted from labels[:, 1:]; None until the first sequence batch
    start_epoch: int = 0
    epoch: int = 0  # the epoch in progress, counted from 0
    step_index: int = 0  # optimizer steps taken
    phase: str = "loading data"  # what an out-of-memory error is reported as happening in
    stop: StopRequest = field(default_factory=StopRequest)  # SIGTERM's request, within fit (gk.preemption)
    stop_agreed: bool = False  # a rank was asked to stop by the last History row (summed over ranks there)
    alone: bool = True  # one process: a stop asked needs no agreement, and is acted on at the next optimizer step
    epoch_start: dict | None = None  # the generators and the loader's state the epoch's order came from
    epoch_begun: tuple[int, int] = (0, 0)  # (optimizer steps, micro-batches of the epoch read) as the epoch began
    initial: dict | None = None  # with a checkpoint_dir, until its first save: the state fit began from, on the host
    options: ModelOptions | None = None  # the model transforms, undone when fit ends
    started: float = field(default_factory=time.perf_counter)  # fit's call (setup's checks and compile wrapper too)

    @property
    def accumulate(self) -> int:
        return self.step.accumulate

    def done(self) -> bool:
        return self.total_steps is not None and self.step_index >= self.total_steps

    def begin(self, saving: Saving, settings: dict, build_schedule: Callable, reporting: Reporting, progress, seed):
        """Before the first step: resumed from the folder's last save, if any (`settings`: what the saves record and a
        resume must match), the reports started, and torch's generator seeded."""
        self.resume_from(saving, settings, build_schedule)
        if saving.in_background:
            self.options.save_in_background(self.checkpoint)
        self.start_reporting(reporting, progress)
        # Dropout's draws, each rank its own. Seeded after the last check: a refused call leaves every generator (CPU
        # and CUDA) as it was; a resumed run restores the saved generators over this at its first epoch.
        if seed is not None:
            torch.manual_seed(seed + distributed.rank())

    def resume_from(self, saving: Saving, settings: dict, build_schedule: Callable) -> None:
        if saving.folder is None:
            return
        plan = {
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "batch_size": getattr(self.loader, "batch_size", None),
            "accumulate": self.accumulate,
            "world_size": distributed.world_size(),
        }
        self.save_every = saving.every
        self.checkpoint = Checkpointer(saving.folder, plan, settings, save_every=saving.every, device=self.device)
        self.checkpoint.hold()  # refused here if another live run trains in this folder
        self.start_epoch, self.step_index = self.checkpoint.resume(self, build_schedule)
        if not self.checkpoint.holds_a_save():
            self.keep_initial_state()
        warn_if_order_cannot_be_saved(self.loader)
        distributed.check_same(self.start_epoch, "the epoch to resume from")

    def start_reporting(self, reporting: Reporting, progress: bool) -> None:
        """The TensorBoard log, the progress bar and the monitor: one of each per job, on its first rank."""
        main = distributed.is_main()
        self.board = open_log(reporting.log_dir if main else None)  # fails before training if the folder is unusable
        self.bar = Progress(
            total=self.total_steps, initial=self.step_index, enabled=progress and main, live_plot=reporting.live_plot
        )
        self.watcher = start_monitor(reporting.monitor, self.device)
        if self.device.type == "cuda":
            watch_out_of_memory()  # so that an out-of-memory error can say how much was asked for

    def target_check(self) -> Callable | None:
        """On a GPU, each batch's class targets checked on the host before their copy (check_host_targets)."""
        if self.device.type == "cpu":
            return None  # an out-of-range target is an IndexError here, which the loss explains
        return partial(check_host_targets, loss=self.loss, device=self.device, epoch=self.epoch)

    def read_first_batch(self, batch: Batch) -> None:
        """What a sample is, and how many a step takes, read from the data itself."""
        self.seen_a_batch = True
        self.micro_batch_size = self.micro_batch_size or batch.size
        self.history.micro_batch_size = self.micro_batch_size
        self.history.global_batch_size = self.micro_batch_size * self.accumulate * distributed.world_size()
        self.history.sample_name = batch.sample_name
        check_first_batch(self.model, batch, self.precision, self.device)  # inputs of another dtype than the weights
        if self.channels_last and not any(t.dim() == 4 and t.is_floating_point() for t in batch.tensors()):
            warnings.warn(
                "channels_last=True applies to 4-D image batches; these inputs have none, so "
                "only the model's 4-D weights were converted.",
                stacklevel=callers_stacklevel(),  # the line that called fit
            )

    def begin_epoch(self, epoch: int) -> tuple[Iterable, int, Tally, LogWindow]:
        """(the epoch's batches, the micro-batches of it already trained on, its tally, a log window): the loader told
        the epoch (its order), the monitor's segment and the GPU's peak memory begun afresh (the previous evaluation
        is not in them); after a resume, the epoch's order replayed and the micro-batches trained before the save."""
        loader = self.loader
        if hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
            loader.sampler.set_epoch(epoch)
        if self.watcher is not None:
            self.watcher.lap()  # the epoch's segment starts here: the previous evaluation is not in it
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        tally = Tally(self.device, self.loss, self.metrics, self.hold_predictions, self.shifted_labels)
        window = LogWindow(self.device)
        if self.checkpoint is None:
            # What the epoch's order comes from, for a failure to read the epoch again (batch_checks.earlier_problem)
            self.epoch_start = {"generators": torch_generators(self.device), "order": order_state(loader)}
            self.epoch_begun = (self.step_index, 0)
            return batches(loader, self.device, check=self.target_check()), 0, tally, window
        epoch_batches, position = self.checkpoint.start_epoch(self, tally, window)
        self.epoch_start = self.checkpoint.epoch_start  # (a resumed epoch's: the one it began with)
        self.epoch_begun = (self.step_index, position)
        return epoch_batches, position, tally, window

    def batches_read(self) -> int:
        """The micro-batches of the epoch read by the last optimizer step (those of an unfinished one not counted)."""
        step, position = self.epoch_begun
        return position + (self.step_index - step) * self.accumulate

    def end_pass(self, epoch: int, micro: int) -> None:
        """After an epoch's batches (`micro` of them): the gradients of a last, incomplete step dropped (data without
        len()); an epoch that gave none refused."""
        if micro % self.accumulate:
            self.step.optimizer.zero_grad(set_to_none=True)
        if micro == 0:
            raise ValueError(
                f"the training data gave no batch in epoch {epoch + 1}; a generator or iterator can be read "
                "only once: pass a list, a Dataset or a DataLoader."
            )

    def save(self, epoch: int, position: int = 0, tally: Tally | None = None, window: LogWindow | None = None):
        """The run into its folder (gpukit.train.checkpoint): at the end of `epoch` (from 1), or within it after
        `position` micro-batches with the epoch's sums so far."""
        self.checkpoint.save(self, epoch, position, tally, window)
        self.initial = None  # a resume from that save is exact now

    def save_and_stop(self, epoch: int, position: int = 0, tally: Tally | None = None, window: LogWindow | None = None):
        """SIGTERM asked the run to stop (how Slurm and Kubernetes preempt, how torchrun and launch stop workers): after
        a whole optimizer step, saved on every rank (with a checkpoint_dir), then Preempted, a KeyboardInterrupt whose
        note (`stopped`) says which save resumes the run."""
        if self.checkpoint is not None:
            self.save(epoch, position, tally, window)
        raise self.stop.preempted()

    def warn_if_data_ended_early(self, epochs: int) -> None:
        """After the last epoch: a schedule laid out over more steps than the data gave (data without len() and
        max_steps, which fit cannot compare before the data ends), said with where the lr stopped. A warning, not an
        error: every step taken is sound and the History is returned; what the reader did not get is the rest of the
        schedule they asked for (the lr may have stopped mid-warm-up, at a fraction of its peak)."""
        if self.total_steps is None or self.step_index >= self.total_steps or not self.history.steps:
            return
        lr = self.history.steps[-1]["lr"]  # the lr the last step trained with
        warnings.warn(
            f"the training data ended after {self.step_index} optimizer steps ({epochs} epoch{'s' * (epochs > 1)} of "
            f"data without len()), short of max_steps={self.total_steps}, over which the lr schedule was laid out: "
            f"training stopped at step {self.step_index} of {self.total_steps} of its schedule, with the lr at {lr:g}, "
            f"{lr / self.peak_lr:.0%} of its peak {self.peak_lr:g}. Pass max_steps={self.step_index} to lay the "
            f"schedule out over the steps the data gives, or more epochs to read it again until step "
            f"{self.total_steps}.",
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )

    def keep_initial_state(self) -> None:
        """A host copy of the model's state (weights, buffers) and the optimizer's, put back if fit is stopped before
        the first save: the same call again (the same model object, as a re-run cell has) then starts from what this
        one started from, and ends bit-equal to a run never stopped. A save at step 0 would do it too, but would leave
        a file behind a call refused at its first batch; this copy costs no disk."""

        def host_copy(value):
            return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value

        self.initial = {
            "model": tree_map(host_copy, self.model.state_dict()),
            "optimizer": tree_map(host_copy, self.step.optimizer.state_dict()),
        }

    def put_back_if_unsaved(self) -> None:
        """After an interrupt before the first save (nothing on disk to resume from): the state fit began from."""
        if self.initial is None or self.checkpoint.holds_a_save():
            return
        self.model.load_state_dict(self.initial["model"])
        self.step.optimizer.load_state_dict(self.initial["optimizer"])

    def how_far(self) -> str:
        """Where training stopped, for the note an interrupted fit's error carries."""
        total = self.total_steps or "no end"
        if self.phase == "optimizer step":  # stopped inside optimizer.step: its update may be applied in part
            where = f"during optimizer step {self.step_index + 1} of {total}: the weights may hold part of its update"
        else:
            where = f"after optimizer step {self.step_index} of {total}: the model is as of that step"
        if self.checkpoint is None:
            saved = "no checkpoint_dir, nothing saved"
        elif self.checkpoint.holds_a_save():
            saved = f"{self.checkpoint.last_good_save()}; fit called again with it resumes from there"
        else:
            return (
                f"fit stopped in epoch {self.epoch + 1} {where.split(':')[0]}, before its first save: the model and "
                "optimizer were put back as fit found them (nothing was saved there yet), so fit called again starts "
                "the run afresh and ends as a run never interrupted."
            )
        return f"fit stopped in epoch {self.epoch + 1} {where} (the unfinished step's gradients were dropped); {saved}."

    def stopped(self, stopped: BaseException) -> None:
        """Training stopped by `stopped` (Ctrl-C, an error): the unfinished step's gradients dropped (they would go
        into the next fit's first), the model as of its last optimizer step (or as fit found it, where nothing was
        saved yet), and a note on `stopped` saying where."""
        self.model.zero_grad(set_to_none=True)
        self.put_back_if_unsaved()
        stopped.add_note(self.how_far())
        crash = worker_crash(stopped)  # a DataLoader worker that died: torch says only that it "exited unexpectedly"
        if crash is not None:
            stopped.add_note(crash)
        stopped.noted_by_fit = True

    def out_of_memory(self, error: torch.OutOfMemoryError) -> torch.OutOfMemoryError:
        """The error to raise for `error`: where the device ran out and what to try. Its numbers are read now, so that
        no reference to `error` is kept: its traceback holds the step's tensors (`release` frees them)."""
        return out_of_memory_error(
            error,
            self.phase,
            self.device,
            batch_size=self.micro_batch_size or 0,
            accumulate=self.accumulate,
            precision=self.precision.name,
        )

    def finish(self) -> None:
        """However fit ends: the save in flight on disk (or its failure named with the save kept), the folder let go,
        the model as it came."""
        try:
            if self.checkpoint is not None:
                self.checkpoint.let_go()
        finally:
            self.options.undo()

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.close()
            self.history.monitor = self.watcher.samples
        if self.bar is not None:
            self.bar.close()
        if self.board is not None:
            self.board.close()
        self.history.skipped_steps = self.precision.skipped_steps
        self.history.seconds += time.perf_counter() - self.started

    def release(self) -> None:
        """Drop everything this run built (the batches, graph, optimizer state), after an out-of-memory error."""
        self.loader = self.parallel = self.step = self.scheduler = self.eval_data = None
        self.model.zero_grad(set_to_none=True)
        free_memory(self.device)


def start_monitor(monitor: bool | Monitor, device: torch.device) -> Monitor | None:
    """A started Monitor, or None (off, or nothing measurable here: said once, nothing added)."""
    if monitor is False or monitor is None:
        return None
    watcher = monitor if isinstance(monitor, Monitor) else Monitor(device)
    if not watcher.available:
        if distributed.is_main():
            print(f"monitor: {watcher.reason}; nothing is added to the History.")
        return None
    return watcher.start()


def epoch_energy(watcher: Monitor, samples) -> dict:
    """The epoch's columns from the monitor; J per sample over this process's samples."""
    row = watcher.lap().as_row()
    local_samples = int(samples) / distributed.world_size()  # the monitor sees this process's device only
    if "energy_j" in row and local_samples:
        row["joules_per_sample"] = row["energy_j"] / local_samples
        row["co2_grams"] = watcher.co2_grams(row["energy_j"])
    return row
