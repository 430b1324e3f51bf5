"""`fit()`: the hand-written PyTorch training loop, for any model and any batch form (gpukit.step).

Read it in this order, one screen each; then gpukit/step/train_step.py (forward, backward, the optimizer step) and
gpukit/precision.py (autocast, loss scaling). That is one training step, whole:

    fit              the run built by setup (every check first: gpukit.train.setup), then trained;
    _train           the epochs, however they end (an interrupt, an out-of-memory error: gpukit.train.run);
    _train_epoch     the batches of one epoch: a micro-step each, an optimizer step every `accumulate`;
    _train_on        one micro-step, a failure said with its batch's number;
    _micro_step      forward and backward of one micro-batch, its loss summed on the device;
    _optimizer_step  the optimizer step, the schedule's, and a History row every `log_every` steps;
    _end_epoch       sum over ranks, evaluate, record, save.

What each calls beside the step is named where it is called and need not be opened to follow a step: moving a batch
to the device (gpukit.train.data), the running sums (gpukit.train.tally, gpukit.train.log_window), DDP's no_sync
(gpukit.distributed), and the run's lifecycle (gpukit.train.run). Features are objects that do nothing when off
(precision, no_sync, the monitor, the progress bar, the TensorBoard log, saving). It never synchronises the host with
the device per step: the running loss, accuracy, metrics and token counts stay on the device and are read every
`log_every` steps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .. import distributed, preemption
from ..precision import Precision
from ..step import Batch, BatchError
from .batch_checks import failed_batch_cause, failed_read_cause, warn_if_scalars_ignored
from .buffers import kept_buffers, put_back
from .checks import describe, explained_model_failure
from .data import batch_on_device, exact_device
from .evaluation import evaluate
from .history import History
from .log_window import LogWindow, write_row
from .options import ModelTransforms, Reporting, Saving, accepts_old_keywords
from .run import Run, epoch_energy, noted_if_interrupted_before_training
from .setup import start_run
from .tally import Tally


@noted_if_interrupted_before_training
@accepts_old_keywords
def fit(
    model: nn.Module,
    train_data,
    *,
    # How much: passes over the data, a cap on optimizer steps, samples per micro-batch, micro-batches per step
    epochs: int = 1,
    max_steps: int | None = None,
    batch_size: int | None = None,
    accumulate: int = 1,
    # How it learns: the optimizer, its learning rate (the peak) and schedule, the loss
    optimizer: str | torch.optim.Optimizer | list[torch.optim.Optimizer] | Callable = "nesterov",
    lr: float | None = None,
    weight_decay: float = 5e-4,
    schedule: str = "onecycle",
    warmup: float | int = 0.2,  # a fraction of the steps (a float below 1), or a number of steps (an int)
    clip: float | None = None,
    loss_fn: str | Callable | None = None,
    # What is measured: held-out data after every epoch, your metrics, how tokens are counted
    eval_data=None,
    metrics: dict[str, Callable] | None = None,
    shifted_labels: bool | None = None,
    # Where and how reproducibly: the device and its number formats, the model's transforms, the seed, the saves
    device: str | torch.device | None = None,
    precision: str | Precision = "fp32",
    transforms: ModelTransforms | None = None,
    seed: int | None = 0,
    saving: Saving | str | Path | None = None,
    # What you see: a progress bar, a History row every log_every optimizer steps, live plots, TensorBoard, energy
    progress: bool = True,
    log_every: int = 10,
    reporting: Reporting | None = None,
) -> History:
    """Train `model` on `train_data` and return the History of what was measured.

    train_data: a Dataset (an ImageDataset gets the device-resident DeviceLoader, a TokenDataset the TextLoader), a
        DataLoader, a device-resident loader, or any re-iterable of batches (len() optional), of any form in
        gpukit.step ((inputs, target), a dict for model(**batch), detection's (images, targets), ...).
    epochs, max_steps: passes over the data, and an optional cap on optimizer steps (needed for data without len()
        unless the schedule is constant).
    batch_size, accumulate: the micro-batch, for a Dataset (a loader brings its own; a last partial batch is kept,
        but not one of a single sample, which BatchNorm cannot train on); accumulate=k sums the gradients of k
        micro-batches before each optimizer step: one k-times larger batch for models without BatchNorm.
    optimizer, lr, weight_decay: a name from gpukit.optim.OPTIMIZERS ("nesterov": SGD with Nesterov momentum 0.9;
        "adamw", "lamb", "lars" and "muon" do not decay 1-D parameters), an Optimizer, a list of them (each for its
        own parameters: SparseAdam for nn.Embedding(sparse=True) tables beside Adam) or a function of the
        parameters; lr is the schedule's peak (default per name: gpukit.optim.DEFAULT_LRS), and an optimizer you
        built keeps its own lrs unless you pass one; weight_decay applies to optimizers built by name. What must
        follow each optimizer step (an EMA teacher's update) is torch's optimizer.register_step_post_hook(fn); keep
        the teacher in the model, which fit saves and resumes.
    schedule, warmup: "onecycle", "linear" or "constant", counted in optimizer steps; the lr warms up over a fraction
        of the steps (warmup=0.2, a float below 1) or over a number of them (warmup=100, an int: data without len()).
    clip: a bound on the gradients' global norm, or None.
    loss_fn: your function of (outputs, target), which gets the outputs exactly as the model returned them, or
        "cross_entropy", "mse", a PyTorch loss or gk.CrossEntropy(label_smoothing=0.1) (smoothing in training only),
        which get the prediction (default: the model's own `loss`, else cross-entropy for integer targets).
    eval_data, metrics: held-out data evaluated after every epoch; {name: fn(outputs, target) -> number}, averaged over
        samples as the columns train_<name> and eval_<name>. Accuracy is added where it means something. eval_data's
        first batch, the loss and the metrics are tried before the first step (gpukit.train.checks).
    shifted_labels: for token sequences, whether tokens are counted from labels[:, 1:], as a causal LM's own loss
        scores them; None measures it at the first batch, as gk.evaluate does (History.shifted_labels says which).
    device, precision: where to train (default: this process's device in a distributed job, else the best here);
        "fp32", "tf32", "bf16-mixed", "fp16-mixed" (with dynamic loss scaling) or a Precision.
    transforms: a gk.ModelTransforms: channels_last, compile, activation checkpointing, offloading, FP8; undone after.
    seed: torch's generators (dropout) and the order of a loader fit builds, seeded with seed + rank after every
        check; not the model's initial weights, nor a loader of yours; None leaves the generators alone (setup.py).
    saving: a folder (or a gk.Saving: how often, in a thread) the run is saved in; a later call with it resumes where
        the last save was, bit-equal to a run never stopped. A SIGTERM (a scheduler preempting the job) ends the step
        in progress, saves the run there on every rank and raises gk.preemption.Preempted, naming the save (a second
        SIGTERM stops at once).
    progress, log_every: a progress bar; a History row every log_every optimizer steps (one synchronisation each).
    reporting: a gk.Reporting: live curves, TensorBoard scalars, the GPU's energy and clocks.
    The keywords from before the groups still work: channels_last, compile, activation_checkpointing,
    offload_activations and fp8 (transforms); checkpoint_dir, save_every, save_in_background (saving); live_plot,
    log_dir and monitor (reporting); warmup_steps=N (warmup=N) and label_smoothing (gk.CrossEntropy).
    """
    run = start_run(**locals())  # every check first, then the run built, resumed and reporting
    try:
        # A SIGTERM from here on is a request: the run saves after its step (every rank alike), then stops.
        with preemption.sigterm_requests_a_stop() as run.stop:
            return _train(run, epochs)
    finally:
        run.finish()  # the last save on disk, the folder let go; the model as it came


def _train(run: Run, epochs: int) -> History:
    """Every epoch; an out-of-memory error frees what the run held, then says where it ran out and what to try; an
    interrupt (or another error) says how far training got."""
    run.model.zero_grad(set_to_none=True)  # not the gradients an interrupted call (or your own loop) left
    run.model.train()
    try:
        try:
            with run.precision.flags():
                for epoch in range(run.start_epoch, epochs):
                    if run.done():
                        break
                    run.epoch = epoch
                    _end_epoch(run, epoch, *_train_epoch(run, epoch))
                    if run.stop_agreed or run.stop.asked and run.alone:
                        raise run.stop.preempted()  # SIGTERM: the epoch's end is saved (_end_epoch)
                if run.stop.asked:  # (after the last History row: nothing to save that is not saved)
                    raise run.stop.preempted()
                run.warn_if_data_ended_early(epochs)  # data without len() that ended before max_steps
        finally:
            run.close()  # (inside the outer try: Ctrl-C as the bar closes gets the note too)
    except torch.OutOfMemoryError as out_of_memory:
        error = run.out_of_memory(out_of_memory)  # read now: no reference to the step's tensors is kept
    except BaseException as stopped:  # KeyboardInterrupt too: the model as of its last optimizer step, and where
        run.stopped(stopped)
        raise
    else:
        return run.history
    run.release()
    # A frame whose local holds the error it raises is a cycle (error -> traceback -> this frame -> local ->
    # error) that keeps the model alive until gc runs: drop the local first.
    try:
        raise error
    finally:
        del error


def _train_epoch(run: Run, epoch: int) -> tuple[Tally, float]:
    """One pass over this rank's data: returns its tally and the seconds it took (evaluation excluded)."""
    started = time.perf_counter()
    epoch_batches, micro, tally, window = run.begin_epoch(epoch)  # (after a resume, what the save had trained)
    batch = None  # a resumed epoch saved at its end (a kill during its evaluation) reads no batch
    device, accumulate = exact_device(run.device), run.accumulate  # looked up once, not per batch
    try:
        for raw in epoch_batches:
            if run.steps_per_epoch is not None and micro == run.steps_per_epoch * accumulate:
                break  # leftover micro-batches would leave gradients behind for the next step
            batch = batch_on_device(raw, device, run.channels_last)
            last = (micro + 1) % accumulate == 0  # the micro-batch whose backward ends an optimizer step
            _train_on(run, batch, micro + 1, epoch, last, tally, window)
            micro += 1
            if last:
                _optimizer_step(run, window, epoch, batch)
                if run.done():
                    break  # the last step is saved with its epoch's row, by _end_epoch
                if run.stop_agreed or run.stop.asked and run.alone:
                    run.save_and_stop(epoch, micro, tally, window)  # SIGTERM: saved after this step, then stopped
                if run.save_every and run.step_index % run.save_every == 0:
                    run.save(epoch, micro, tally, window)
    except Exception as error:  # reading a batch failed (the loader, the copy): what its data shows, with its number
        cause = failed_read_cause(error)
        if cause is None:
            raise
        raise BatchError(f"batch {micro + 1} of epoch {epoch + 1}: {cause}") from error
    run.end_pass(epoch, micro)  # an incomplete last step's gradients dropped; an epoch without batches refused
    if window.steps:
        write_row(run, window, epoch, batch)
    return tally, time.perf_counter() - started


def _train_on(run: Run, batch: Batch, number: int, epoch: int, last: bool, tally: Tally, window: LogWindow) -> None:
    """A micro-step on the epoch's batch `number` (from 1); a failure whose cause its data shows is said with
    that batch's number, any other gets the number as a note. Nothing here reads the device. A first batch refused
    leaves the model's buffers (BatchNorm's statistics, which its forward moved) as they were: a refused call
    changes nothing of the model."""
    kept = None if run.seen_a_batch else kept_buffers(run.model)
    try:
        if batch.size == 0:  # known on the host, from the shape: no kernel
            raise BatchError(
                "it holds 0 samples, whose mean loss is 0/0 = NaN, which would make the weights NaN. Leave empty "
                "batches out (a sampler, collate_fn or filter that can yield one)."
            )
        if not run.seen_a_batch:
            run.read_first_batch(batch)  # what a sample is; inputs of another dtype than the weights refused
        _micro_step(run, batch, last, tally, window)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        put_back(kept or ())
        cause = failed_batch_cause(error, run.model, batch)
        if cause is None:
            error.add_note(f"It failed on batch {number} of epoch {epoch + 1}: {describe(batch)}.")
            raise
        raise BatchError(f"batch {number} of epoch {epoch + 1} ({describe(batch)}): {cause}") from error


def _micro_step(run: Run, batch: Batch, last: bool, tally: Tally, window: LogWindow) -> None:
    """Forward and backward of one micro-batch; gradients stay local (no all-reduce) until the step's last."""
    run.phase = "forward"
    explain = None if run.seen_outputs else explained_model_failure(run.model, batch)  # the first batch's call
    with distributed.no_sync(run.parallel, not last):
        loss, outputs, parts = run.step.forward(batch, explain)
        run.phase = "backward"
        run.step.backward(loss)
    if not run.seen_outputs:
        run.seen_outputs = True
        warn_if_scalars_ignored(run.loss, outputs)
    loss = loss.detach()  # once for both: each keeps it until its sums are added
    tokens = tally.add(batch, loss, outputs, parts)
    run.shifted_labels = tally.shifted_labels  # decided at the first sequence batch: kept for the whole run
    window.add(batch, loss, parts, tokens)
    run.phase = "loading data"


def _optimizer_step(run: Run, window: LogWindow, epoch: int, batch: Batch) -> None:
    run.phase = "optimizer step"
    window.lrs = [group["lr"] for group in run.step.optimizer.param_groups]  # this step's: the schedule moves on next
    run.step.step()
    run.step_index += 1  # the weights hold it now (what an interrupted fit's note says), the schedule steps next
    run.phase = "loading data"
    run.scheduler.step()
    window.steps += 1
    if window.steps == run.log_every or run.step_index == run.total_steps:
        write_row(run, window, epoch, batch)


def _end_epoch(run: Run, epoch: int, tally: Tally, seconds: float) -> None:
    """Sum the epoch over ranks, evaluate, record the row, and save the run."""
    tally.over_ranks()  # one all-reduce
    run.hold_predictions = run.hold_predictions and not tally.uncounted  # targets written in place: count at once
    energy = epoch_energy(run.watcher, tally.samples) if run.watcher is not None else {}
    run.phase = "evaluation"
    row = {"epoch": epoch + 1} | tally.read("train_")
    distributed.broadcast_buffers(run.model)  # every rank evaluates (and rank 0 saves) rank 0's BatchNorm statistics
    if run.eval_data is not None:
        result = evaluate(
            run.model,
            run.eval_data,
            precision=run.precision,
            device=run.device,
            channels_last=run.channels_last,
            loss_fn=run.eval_loss,
            metrics=run.metrics,
            over_ranks=True,  # each rank a share of the batches; every rank reports the whole data's figures
            shifted_labels=run.shifted_labels,  # the training data's rule
        )
        counts = ("samples", "tokens", "shifted_labels")
        row |= {f"eval_{name}": value for name, value in result.items() if name not in counts}
    if tally.sequences:
        run.history.shifted_labels = bool(run.shifted_labels)
    row["peak_memory"] = torch.cuda.max_memory_allocated(run.device) if run.device.type == "cuda" else None
    row |= {"seconds": seconds} | energy
    run.history.epochs.append(row)
    run.board.add_epoch(row)
    run.bar.epoch_done(run.history)
    run.phase = "loading data"
    if run.checkpoint is not None:
        run.save(epoch + 1)
