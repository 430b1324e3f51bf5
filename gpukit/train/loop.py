"""`fit()`: the hand-written PyTorch loop, with the features a lesson needs as objects that do
nothing when off, for any model and any batch form (see gpukit.step).

It never synchronises the host with the device per step: the running loss, accuracy, metrics
and token counts stay on the device and are read every `log_every` steps.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from .. import distributed
from ..env import resolve_device
from ..hardware.monitor import Monitor
from ..memory.allocator import free_memory, out_of_memory_error, watch_out_of_memory
from ..optim import SCHEDULES, check_lr, default_lr, make_optimizer, make_schedule
from ..precision import Precision, get_precision
from ..runfile import run_environment
from ..step import Batch, Loss, TrainStep
from .checkpoint import Checkpointer
from .data import as_loader, batches, length, prepare
from .evaluate import evaluate
from .history import History
from .tally import Tally, check_metrics
from .tensorboard_log import open_log


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss."""


# ---------------------------------------------------------------------------------------------
# fit


def _check_arguments(epochs, accumulate, clip, lr, log_every, schedule, max_steps):
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}.")
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an integer >= 1 (micro-batches per optimizer step), got {accumulate!r}.")
    if clip is not None and not clip > 0:
        raise ValueError(f"clip must be a positive gradient-norm bound or None, got {clip!r}.")
    if lr is not None:
        check_lr(lr)
    if not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}.")


class _Window:
    """Sums over the optimizer steps between two log points, kept on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss = torch.zeros((), device=self.device)
        self.tokens: torch.Tensor | None = None
        self.micro_batches = self.samples = self.steps = 0
        self.started = time.perf_counter()

    def add(self, batch: Batch, loss: torch.Tensor) -> None:
        self.loss += loss.detach()
        self.micro_batches += 1
        self.samples += batch.size
        tokens = batch.count_tokens()
        if tokens is not None:
            self.tokens = tokens if self.tokens is None else self.tokens + tokens

    def row(self, step: int, epoch: int, lr: float) -> dict:
        """One History.steps row: one synchronisation (and in a distributed job one all-reduce)."""
        tokens = self.tokens if self.tokens is not None else torch.zeros((), device=self.device)
        loss, tokens = torch.stack(distributed.sum_over_ranks(self.loss.double(), tokens.double())).tolist()
        ranks = distributed.world_size()
        elapsed = time.perf_counter() - self.started  # after the synchronisation: the GPU's work is done
        row = {
            "step": step, "epoch": epoch, "loss": loss / (ranks * self.micro_batches), "lr": lr,
            "step_time": elapsed / self.steps, "samples_per_second": self.samples * ranks / elapsed,
        }  # fmt: skip
        if self.tokens is not None:
            row["tokens_per_second"] = tokens / elapsed
        return row


def fit(
    model: nn.Module,
    train_data,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    lr: float | None = None,
    optimizer: str | torch.optim.Optimizer | Callable = "sgd",
    weight_decay: float = 5e-4,
    schedule: str = "onecycle",
    warmup: float = 0.2,
    precision: str | Precision = "fp32",
    accumulate: int = 1,
    clip: float | None = None,
    channels_last: bool = False,
    compile: bool | dict = False,
    device: str | torch.device | None = None,
    eval_data=None,
    loss_fn: str | Callable | None = None,
    label_smoothing: float = 0.0,
    metrics: dict[str, Callable] | None = None,
    progress: bool = True,
    live_plot: bool = False,
    log_every: int = 10,
    max_steps: int | None = None,
    checkpoint_dir: str | Path | None = None,
    log_dir: str | Path | None = None,
    seed: int = 0,
    monitor: bool | Monitor = False,
) -> History:
    """Train `model` on `train_data` and return the History of what was measured.

    train_data: a Dataset (an ImageDataset gets the device-resident DeviceLoader, a TokenDataset
        the TextLoader), a DataLoader, a device-resident loader, or any re-iterable of batches
        (len() optional). Batches and model outputs of any form in gpukit.step: (inputs, target),
        dict batches for model(**batch), outputs as tensors, tuples or Hugging Face-style objects.
    loss_fn: a function of (outputs, target), "cross_entropy" or "mse"; default the model's own
        `loss` if it returns one, else cross-entropy for integer targets.
    metrics: {name: fn(outputs, target) -> number}, averaged over samples per epoch, as columns
        train_<name> and eval_<name>. Accuracy is added where it means something.
    optimizer: a name from gpukit.optim.OPTIMIZERS ("sgd" is Nesterov momentum 0.9; "adamw",
        "lamb", "lars" and "muon" do not decay 1-D parameters), an Optimizer, or a function of
        the parameters.
    lr: the schedule's peak (default per name, gpukit.optim.DEFAULT_LRS: 0.05 for SGD, 1e-3 for
        AdamW); an Optimizer or a function you pass keeps its own learning rates unless you also
        pass lr.
    accumulate=k sums gradients over k micro-batches before each optimizer step, which equals one
        k-times larger batch for models without BatchNorm. `batch_size` is the micro-batch; the
        learning-rate schedule counts optimizer steps (max_steps caps them).
    compile: True (torch.compile with its defaults) or a dict of torch.compile options.
    With `checkpoint_dir`, the model, optimizer, schedule, loss scaler and history are saved after
    every epoch (atomically), and a later call with the same directory resumes.
    monitor: True (or a gk.hardware.Monitor, e.g. with your grid intensity) samples the GPU at
        10 Hz and adds to each epoch energy_j, joules_per_sample, co2_grams, mean_power_w,
        mean_utilization and throttle_reasons (on a CPU: RAPL energy where readable); the samples
        are History.monitor. Where nothing can be measured it says so in one line and adds nothing.
    log_dir: a folder (one per run) for TensorBoard scalars of every logged step and epoch (the
        History's columns); needs the `log` extra (pip install 'gpukit[log]').
    """
    _check_arguments(epochs, accumulate, clip, lr, log_every, schedule, max_steps)
    device = resolve_device(device if device is not None else distributed.default_device())
    precision = get_precision(precision, device)  # raises before any work if unsupported here
    loss = Loss(loss_fn, label_smoothing)
    metrics = check_metrics(metrics)
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to train, got {type(model).__name__}.")
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters to train.")
    loader = as_loader(train_data, batch_size, device, shuffle=True, channels_last=channels_last, seed=seed)
    if epochs > 1 and isinstance(loader, Iterator):  # a generator: its second epoch would be empty
        raise ValueError(
            f"the training data is a {type(loader).__name__}, which can be read only once, but epochs={epochs}; pass a "
            "list, a Dataset, a DataLoader or an object whose __iter__ starts afresh, or train one epoch."
        )
    loader = distributed.shard(loader)  # in a distributed job, this rank's part of the data
    batches_per_epoch = length(loader)
    if batches_per_epoch == 0:
        dataset = getattr(loader, "dataset", None)
        size = f"{len(dataset)} examples" if hasattr(dataset, "__len__") else "the data"
        raise ValueError(
            f"the training data gives no batch: {size} with batch size {getattr(loader, 'batch_size', '?')} and "
            "drop_last; use a smaller batch_size or more data."
        )
    steps_per_epoch = max(batches_per_epoch // accumulate, 1) if batches_per_epoch is not None else None
    if steps_per_epoch is None:
        total_steps = max_steps
        if total_steps is None and (schedule != "constant" or 0 < warmup < 1):
            raise ValueError(
                f"the training data has no len(), so fit cannot tell how many steps the {schedule!r} schedule spans: "
                "pass max_steps=N (the schedule then spans N optimizer steps), give the data a __len__ (epochs × its "
                "length sets the schedule), or use schedule='constant' with warmup in steps (warmup=0 or e.g. 100)."
            )
    else:
        total_steps = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)

    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    peak_lr = lr if lr is not None else default_lr(optimizer)
    built = make_optimizer(optimizer, model, peak_lr, weight_decay)
    if lr is not None or isinstance(optimizer, str):
        for group in built.param_groups:
            group["lr"] = peak_lr  # the schedule's peak
    peak_lr = built.param_groups[0]["lr"]
    scheduler = make_schedule(built, schedule, total_steps, warmup)
    parallel = distributed.prepare(model)  # DDP in a distributed job, else the model itself
    forward = torch.compile(parallel, **(compile if isinstance(compile, dict) else {})) if compile else parallel
    step = TrainStep(forward, built, precision, loss,
                     parameters=model.parameters(), accumulate=accumulate, clip=clip)  # fmt: skip
    history = History(precision=precision.name, device=str(device), environment=run_environment(device))
    plan = {
        "total_steps": total_steps, "steps_per_epoch": steps_per_epoch,
        "batch_size": getattr(loader, "batch_size", None), "accumulate": accumulate,
    }  # fmt: skip
    checkpoint = Checkpointer(checkpoint_dir, plan) if checkpoint_dir is not None else None
    start_epoch, step_index = checkpoint.resume(model, built, scheduler, precision, history) if checkpoint else (0, 0)
    distributed.check_same(start_epoch, "the epoch to resume from")

    board = open_log(log_dir if distributed.is_main() else None)  # one writer per job; fails before training

    from ..widgets import Progress

    enabled = progress and distributed.is_main()  # one bar per job, not one per rank
    bar = Progress(total=total_steps, initial=step_index, enabled=enabled, live_plot=live_plot)
    if device.type == "cuda":
        watch_out_of_memory()  # so that an out-of-memory error can say how much was asked for
    phase, out_of_memory = "loading data", None  # the phase an out-of-memory error is reported in
    micro_batch_size, first_batch = plan["batch_size"], True
    watcher = _start_monitor(monitor, device)
    eval_loss = Loss(loss_fn) if label_smoothing else loss  # held-out loss without smoothing
    started = time.perf_counter()
    model.train()
    try:
        with precision.flags():
            for epoch in range(start_epoch, epochs):
                if total_steps is not None and step_index >= total_steps:
                    break
                if hasattr(loader, "set_epoch"):
                    loader.set_epoch(epoch)
                elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
                    loader.sampler.set_epoch(epoch)
                epoch_started = time.perf_counter()
                if watcher is not None:
                    watcher.lap()  # the epoch's segment starts here: the previous evaluation is not in it
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                tally, window = Tally(device, loss, metrics), _Window(device)
                micro = 0
                for raw in batches(loader, device):
                    if steps_per_epoch is not None and micro == steps_per_epoch * accumulate:
                        break  # leftover micro-batches would leave gradients behind for the next step
                    batch = prepare(raw, device, channels_last)
                    if first_batch:  # what a sample is, and how many a step takes, read from the data itself
                        first_batch = False
                        micro_batch_size = micro_batch_size or batch.size
                        history.batch_size = micro_batch_size * accumulate * distributed.world_size()
                        history.sample_name = batch.sample_name
                        if channels_last and not any(t.dim() == 4 and t.is_floating_point() for t in batch.tensors()):
                            warnings.warn("channels_last=True applies to 4-D image batches; these inputs have none, so "
                                          "only the model's 4-D weights were converted.", stacklevel=2)  # fmt: skip
                    phase = "forward"
                    # Micro-batches that do not step keep their gradients local: one all-reduce per step.
                    with distributed.no_sync(parallel, (micro + 1) % accumulate != 0):
                        value, prediction, model_loss = step.forward(batch)
                        phase = "backward"
                        step.backward(value)
                    tally.add(batch, value, prediction, model_loss)
                    window.add(batch, value)
                    micro += 1
                    phase = "loading data"
                    if micro % accumulate:
                        continue
                    phase = "optimizer step"
                    step.step()
                    scheduler.step()
                    phase = "loading data"
                    step_index += 1
                    window.steps += 1
                    if window.steps == log_every or step_index == total_steps:
                        _log(window, history, bar, board, step_index, epoch, built, precision, peak_lr)
                    if total_steps is not None and step_index >= total_steps:
                        break
                if micro % accumulate:  # data without len(): drop the gradients of the last, incomplete step
                    built.zero_grad(set_to_none=True)
                if micro == 0:
                    raise ValueError(
                        f"the training data gave no batch in epoch {epoch + 1}; a generator or iterator can be read "
                        "only once: pass a list, a Dataset or a DataLoader."
                    )
                if window.steps:
                    _log(window, history, bar, board, step_index, epoch, built, precision, peak_lr)
                *sums, samples = distributed.sum_over_ranks(*tally.tensors(), tally.samples)  # one all-reduce
                tally.replace(sums, samples)
                seconds = time.perf_counter() - epoch_started  # training only, evaluation excluded
                energy = _epoch_energy(watcher, samples) if watcher is not None else {}
                phase = "evaluation"
                row = {"epoch": epoch + 1} | tally.read("train_")
                if eval_data is not None:
                    result = evaluate(model, eval_data, precision=precision, device=device, channels_last=channels_last,
                                      loss_fn=eval_loss, metrics=metrics)  # fmt: skip
                    row |= {
                        f"eval_{name}": value for name, value in result.items() if name not in ("samples", "tokens")
                    }
                row["peak_memory"] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
                row["seconds"] = seconds
                row |= energy
                history.epochs.append(row)
                board.add_epoch(row)
                bar.epoch_done(history)
                if checkpoint:
                    if distributed.is_main():  # one writer: every rank holds the same state
                        checkpoint.save(epoch + 1, step_index, model, built, scheduler, precision, history)
                    distributed.barrier()  # no rank runs ahead of a checkpoint that is not yet complete
    except torch.OutOfMemoryError as error:
        # Read the numbers now; keep no reference to `error`, whose traceback holds the step's tensors.
        out_of_memory = out_of_memory_error(error, phase, device, batch_size=micro_batch_size or 0,
                                            accumulate=accumulate, precision=precision.name)  # fmt: skip
    finally:
        if watcher is not None:
            watcher.close()
            history.monitor = watcher.samples
        bar.close()
        board.close()
        history.skipped_steps = precision.skipped_steps
        history.seconds += time.perf_counter() - started
    if out_of_memory is not None:
        # The raised error's traceback keeps this frame, and so these variables, alive: drop what
        # this call allocated so that the notebook kernel can go on without a restart.
        batch = raw = value = prediction = model_loss = built = scheduler = loader = step = parallel = tally = None
        window = None
        model.zero_grad(set_to_none=True)
        free_memory(device)
        # A frame whose local holds the error it raises is a cycle (error -> traceback -> this frame ->
        # local -> error) that keeps `model` and all above alive until gc runs: drop the local first.
        error, out_of_memory = out_of_memory, None
        try:
            raise error
        finally:
            del error
    return history


def _start_monitor(monitor: bool | Monitor, device: torch.device) -> Monitor | None:
    """A started Monitor, or None (off, or nothing measurable here: said once, nothing added)."""
    if monitor is False or monitor is None:
        return None
    watcher = monitor if isinstance(monitor, Monitor) else Monitor(device)
    if not watcher.available:
        if distributed.is_main():
            print(f"monitor: {watcher.reason}; nothing is added to the History.")
        return None
    return watcher.start()


def _epoch_energy(watcher: Monitor, samples) -> dict:
    """The epoch's columns from the monitor; J per sample over this process's samples."""
    row = watcher.lap().as_row()
    local_samples = int(samples) / distributed.world_size()  # the monitor sees this process's device only
    if "energy_j" in row and local_samples:
        row["joules_per_sample"] = row["energy_j"] / local_samples
        row["co2_grams"] = watcher.co2_grams(row["energy_j"])
    return row


def _log(
    window: _Window, history: History, bar, board, step_index: int, epoch: int, optimizer, precision, peak_lr
) -> None:
    row = window.row(step_index, epoch + 1, optimizer.param_groups[0]["lr"])
    if not math.isfinite(row["loss"]):
        raise NonFiniteLossError(
            f"the loss became {row['loss']} between optimizer steps {step_index - window.steps + 1} and {step_index} "
            f"(epoch {epoch + 1}, precision={precision.name}, peak lr={peak_lr:g}). Try a lower lr, more warm-up, gradient "
            "clipping (clip=1.0), or bf16-mixed instead of fp16-mixed (or loss scaling if you scale by hand)."
        )
    history.steps.append(row)
    board.add_step(row)
    bar.update(window.steps, row, history)
    window.reset()
