"""`fit()` and `evaluate()`, and the `History` that fit returns.

The loop is the hand-written PyTorch loop, with the features a lesson needs as objects
that do nothing when off. It never synchronises the host with the device per step: the
running loss and accuracy stay on the device and are read every `log_every` steps.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from . import distributed
from .data import DeviceLoader, ImageDataset
from .env import resolve_device
from .memory import free_memory, out_of_memory_error, watch_out_of_memory
from .precision import Precision, get_precision

SCHEDULES = ("onecycle", "linear", "constant")
OPTIMIZERS = ("sgd", "adamw")


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed: damaged, or written by a different run."""


@dataclass
class History:
    """What a run measured.

    steps:  one row per logged window of `log_every` optimizer steps: step (the last in the
            window), epoch, loss (mean over the window), lr, step_time (s, mean over the
            window), images_per_second.
    epochs: one row per epoch: epoch, train_loss, train_accuracy, eval_loss, eval_accuracy,
            peak_memory (bytes allocated on a CUDA device; None where not measured), seconds.
    """

    steps: list[dict] = field(default_factory=list)
    epochs: list[dict] = field(default_factory=list)
    precision: str = "fp32"
    device: str = "cpu"
    batch_size: int = 0
    skipped_steps: int = 0  # fp16 steps skipped by the loss scaler
    seconds: float = 0.0  # wall time of the whole fit, evaluation included

    @property
    def losses(self) -> list[float]:
        return [row["loss"] for row in self.steps]

    @property
    def final_eval_accuracy(self) -> float | None:
        return self.epochs[-1]["eval_accuracy"] if self.epochs else None

    @property
    def final_train_accuracy(self) -> float | None:
        return self.epochs[-1]["train_accuracy"] if self.epochs else None

    def steady_rows(self) -> list[dict]:
        """Logged windows after the first (which holds warm-up, compilation, cuDNN autotuning)."""
        return self.steps[1:] if len(self.steps) > 1 else self.steps

    @property
    def step_time(self) -> float:
        """Median seconds per optimizer step in steady state."""
        return _median([row["step_time"] for row in self.steady_rows()])

    @property
    def images_per_second(self) -> float:
        """Median training throughput in steady state (images/s)."""
        return _median([row["images_per_second"] for row in self.steady_rows()])

    @property
    def peak_memory(self) -> int | None:
        values = [row["peak_memory"] for row in self.epochs if row["peak_memory"] is not None]
        return max(values) if values else None

    def summary(self) -> dict:
        return {
            "precision": self.precision,
            "batch_size": self.batch_size,
            "eval_accuracy": self.final_eval_accuracy,
            "train_accuracy": self.final_train_accuracy,
            "images_per_second": self.images_per_second,
            "step_time_ms": self.step_time * 1e3,
            "peak_memory_MiB": None if self.peak_memory is None else self.peak_memory / 2**20,
            "skipped_steps": self.skipped_steps,
            "seconds": self.seconds,
        }

    def table(self):
        from .report import Table

        return Table(self.epochs, title=f"{self.precision}, batch {self.batch_size} on {self.device}")

    def plot(self, **kwargs):
        from .plots import plot_history

        return plot_history(self, **kwargs)


def _median(values: list[float]) -> float:
    values = sorted(v for v in values if v is not None and math.isfinite(v))
    if not values:
        return float("nan")
    middle = len(values) // 2
    return values[middle] if len(values) % 2 else (values[middle - 1] + values[middle]) / 2


# ---------------------------------------------------------------------------------------------
# Building blocks


def make_optimizer(
    optimizer: str | torch.optim.Optimizer | Callable, parameters: Iterable, lr: float, weight_decay: float
) -> torch.optim.Optimizer:
    """'sgd' (Nesterov momentum 0.9), 'adamw', an optimizer, or a function of the parameters."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    if callable(optimizer):
        return optimizer(parameters)
    if optimizer == "sgd":
        return torch.optim.SGD(parameters, lr=lr, momentum=0.9, nesterov=True, weight_decay=weight_decay)
    if optimizer == "adamw":
        return torch.optim.AdamW(parameters, lr=lr, weight_decay=weight_decay)
    raise ValueError(
        f"optimizer={optimizer!r} is unknown; use 'sgd', 'adamw', an Optimizer or a function of the parameters."
    )


def make_schedule(
    optimizer: torch.optim.Optimizer, schedule: str, total_steps: int, warmup: float
) -> torch.optim.lr_scheduler.LRScheduler:
    """Warm-up then one-cycle (cosine) decay, linear decay to zero, or constant.

    `warmup` is a fraction of all steps (< 1) or a number of steps (>= 1). The one-cycle
    schedule is torch's OneCycleLR, with the learning rate only (momentum is left as set).
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")
    total_steps = max(total_steps, 1)
    warmup_steps = warmup * total_steps if warmup < 1 else warmup
    warmup_steps = min(max(warmup_steps, 0), total_steps)
    if schedule == "onecycle":
        peak = [group["lr"] for group in optimizer.param_groups]
        return torch.optim.lr_scheduler.OneCycleLR(
            optimizer, max_lr=peak, total_steps=total_steps + 1, pct_start=max(warmup_steps / (total_steps + 1), 1e-6),
            anneal_strategy="cos", cycle_momentum=False, div_factor=25.0, final_div_factor=1e4,
        )  # fmt: skip

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        if schedule == "constant":
            return 1.0
        return max(0.0, (total_steps - step) / max(total_steps - warmup_steps, 1))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def as_loader(
    data, batch_size: int | None, device: torch.device, *, shuffle: bool, channels_last: bool = False, seed: int = 0
):
    """A Dataset, a DataLoader or a DeviceLoader → something that yields (images, labels) batches."""
    if isinstance(data, (DeviceLoader, DataLoader)):
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from the loader's batch_size={data.batch_size}; "
                "leave batch_size=None when passing a loader, or build the loader with the size you want."
            )
        if isinstance(data, DeviceLoader) and data.device != device:
            raise ValueError(
                f"the DeviceLoader keeps its data on {data.device} but training runs on {device}; make them agree."
            )
        return data
    if not isinstance(data, Dataset):
        raise TypeError(f"expected a Dataset, a DataLoader or a DeviceLoader, got {type(data).__name__}.")
    if batch_size is None:
        raise ValueError("batch_size is required when passing a Dataset (or pass a loader that has one).")
    if batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
    if len(data) == 0:
        raise ValueError("the dataset is empty; give it at least one example.")
    if isinstance(data, ImageDataset):
        return DeviceLoader(data, batch_size, shuffle=shuffle, device=device, channels_last=channels_last, seed=seed)
    return DataLoader(
        data, batch_size=batch_size, shuffle=shuffle, drop_last=shuffle, generator=torch.Generator().manual_seed(seed)
    )


def _num_classes(model: nn.Module, data) -> int | None:
    dataset = getattr(data, "dataset", data)
    return len(dataset.classes) if hasattr(dataset, "classes") else None


def _check_labels(dataset, num_classes: int | None) -> None:
    labels = getattr(dataset, "labels", None)
    if labels is None or num_classes is None or len(labels) == 0:
        return
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or high >= num_classes:
        raise ValueError(
            f"labels must lie in 0..{num_classes - 1}, found {low}..{high}; fix the labels or the model's num_classes."
        )


def _model_outputs(model: nn.Module) -> int | None:
    last_linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
    return last_linear[-1].out_features if last_linear else None


# ---------------------------------------------------------------------------------------------
# evaluate


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data,
    *,
    batch_size: int | None = 512,
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    channels_last: bool = False,
    loss_fn: Callable = nn.functional.cross_entropy,
) -> dict:
    """Accuracy and mean loss of `model` on `data` (a Dataset or a loader), in eval mode."""
    device = resolve_device(device) if device is not None else next(model.parameters()).device
    precision = get_precision(precision, device)
    if isinstance(data, (DeviceLoader, DataLoader)):
        batch_size = None
    loader = as_loader(data, batch_size, device, shuffle=False, channels_last=channels_last)
    was_training = model.training
    model.eval()
    total_loss = torch.zeros((), device=device)
    correct = torch.zeros((), device=device, dtype=torch.long)
    count = 0
    try:
        for images, labels in loader:
            images, labels = images.to(device, non_blocking=True), labels.to(device, non_blocking=True)
            with precision.autocast():
                logits = model(images)
                total_loss += loss_fn(logits.float(), labels, reduction="sum")
            correct += (logits.argmax(1) == labels).sum()
            count += len(labels)
    finally:
        model.train(was_training)
    if count == 0:
        raise ValueError("evaluate() got no batches; the dataset is empty or smaller than one batch with drop_last.")
    return {"accuracy": correct.item() / count, "loss": total_loss.item() / count, "images": count}


# ---------------------------------------------------------------------------------------------
# fit


def _check_arguments(epochs, accumulate, clip, lr, log_every, schedule):
    if not isinstance(epochs, int) or epochs < 0:
        raise ValueError(f"epochs must be an integer >= 0, got {epochs!r}.")
    if not isinstance(accumulate, int) or accumulate < 1:
        raise ValueError(f"accumulate must be an integer >= 1 (micro-batches per optimizer step), got {accumulate!r}.")
    if clip is not None and clip <= 0:
        raise ValueError(f"clip must be a positive gradient-norm bound or None, got {clip!r}.")
    if lr <= 0:
        raise ValueError(f"lr must be positive, got {lr!r}.")
    if log_every < 1:
        raise ValueError(f"log_every must be >= 1, got {log_every!r}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")


def fit(
    model: nn.Module,
    train_data,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    lr: float = 0.05,
    optimizer: str | torch.optim.Optimizer | Callable = "sgd",
    weight_decay: float = 5e-4,
    schedule: str = "onecycle",
    warmup: float = 0.2,
    precision: str | Precision = "fp32",
    accumulate: int = 1,
    clip: float | None = None,
    channels_last: bool = False,
    compile: bool = False,
    device: str | torch.device | None = None,
    eval_data=None,
    loss_fn: Callable = nn.functional.cross_entropy,
    label_smoothing: float = 0.0,
    progress: bool = True,
    live_plot: bool = False,
    log_every: int = 10,
    max_steps: int | None = None,
    checkpoint_dir: str | Path | None = None,
    seed: int = 0,
) -> History:
    """Train `model` on `train_data` and return the History of what was measured.

    train_data: a Dataset (an ImageDataset gets the device-resident loader), a DataLoader
    or a DeviceLoader. `accumulate=k` sums gradients over k micro-batches before each
    optimizer step, which equals one k-times larger batch for models without BatchNorm.
    `batch_size` is the micro-batch; the learning-rate schedule counts optimizer steps.
    With `checkpoint_dir`, the model, optimizer, schedule, loss scaler and history are saved
    after every epoch (atomically), and a later call with the same directory resumes.
    """
    _check_arguments(epochs, accumulate, clip, lr, log_every, schedule)
    device = resolve_device(device if device is not None else distributed.default_device())
    precision = get_precision(precision, device)  # raises before any work if unsupported here
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters to train.")
    loader = as_loader(train_data, batch_size, device, shuffle=True, channels_last=channels_last, seed=seed)
    loader = distributed.shard(loader)  # in a distributed job, this rank's part of the data
    _check_labels(getattr(loader, "dataset", None), _model_outputs(model))
    batches_per_epoch = len(loader)
    if batches_per_epoch == 0:
        raise ValueError(
            f"the training data gives no batch: {len(loader.dataset)} examples with batch size {loader.batch_size} "
            "and drop_last; use a smaller batch_size or more data."
        )
    steps_per_epoch = max(batches_per_epoch // accumulate, 1)
    total_steps = steps_per_epoch * epochs if max_steps is None else min(max_steps, steps_per_epoch * epochs)

    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(optimizer, model.parameters(), lr, weight_decay)
    for group in optimizer.param_groups:
        group["lr"] = lr  # the schedule's peak
    scheduler = make_schedule(optimizer, schedule, total_steps, warmup)
    parallel = distributed.prepare(model)  # DDP in a distributed job, else the model itself
    forward = torch.compile(parallel) if compile else parallel
    if label_smoothing:
        base_loss = loss_fn

        def loss_fn(logits, labels):
            return base_loss(logits, labels, label_smoothing=label_smoothing)

    images_per_step = loader.batch_size * accumulate * distributed.world_size()  # all ranks together
    history = History(precision=precision.name, device=str(device), batch_size=images_per_step)
    plan = {
        "total_steps": total_steps,
        "steps_per_epoch": steps_per_epoch,
        "batch_size": loader.batch_size,
        "accumulate": accumulate,
    }
    checkpoint = _Checkpointer(checkpoint_dir, plan) if checkpoint_dir is not None else None
    start_epoch = checkpoint.resume(model, optimizer, scheduler, precision, history) if checkpoint else 0
    distributed.check_same(start_epoch, "the epoch to resume from")

    from .widgets import Progress

    enabled = progress and distributed.is_main()  # one bar per job, not one per rank
    bar = Progress(total=total_steps, initial=start_epoch * steps_per_epoch, enabled=enabled, live_plot=live_plot)
    if device.type == "cuda":
        watch_out_of_memory()  # so that an out-of-memory error can say how much was asked for
    phase, out_of_memory = "loading data", None  # the phase an out-of-memory error is reported in
    started = time.perf_counter()
    step = start_epoch * steps_per_epoch
    model.train()
    try:
        with precision.flags():
            for epoch in range(start_epoch, epochs):
                if step >= total_steps:
                    break
                if hasattr(loader, "set_epoch"):
                    loader.set_epoch(epoch)
                elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
                    loader.sampler.set_epoch(epoch)
                epoch_started = time.perf_counter()
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats(device)
                # Running sums live on the device: adding to them does not wait for the GPU.
                window_loss = torch.zeros((), device=device)
                epoch_loss = torch.zeros((), device=device)
                epoch_correct = torch.zeros((), device=device, dtype=torch.long)
                epoch_seen, window_steps, window_images = 0, 0, 0
                window_started = time.perf_counter()
                micro = 0
                for images, labels in loader:
                    if micro == steps_per_epoch * accumulate:
                        break  # leftover micro-batches would leave gradients behind for the next step
                    images = images.to(device, non_blocking=True)
                    labels = labels.to(device, non_blocking=True)
                    if channels_last:
                        images = images.contiguous(memory_format=torch.channels_last)
                    phase = "forward"
                    # Micro-batches that do not step keep their gradients local: one all-reduce per step.
                    with distributed.no_sync(parallel, (micro + 1) % accumulate != 0):
                        with precision.autocast():
                            logits = forward(images)
                            loss = loss_fn(logits.float(), labels)
                        phase = "backward"
                        precision.backward(loss / accumulate)
                    loss = loss.detach()
                    window_loss += loss
                    epoch_loss += loss * len(labels)
                    epoch_correct += (logits.detach().argmax(1) == labels).sum()
                    epoch_seen += len(labels)
                    window_images += len(labels)
                    micro += 1
                    phase = "loading data"
                    if micro % accumulate:
                        continue
                    phase = "optimizer step"
                    precision.step(optimizer, model.parameters(), clip)
                    optimizer.zero_grad(set_to_none=True)
                    scheduler.step()
                    phase = "loading data"
                    step += 1
                    window_steps += 1
                    if window_steps == log_every or step == total_steps or micro + accumulate > batches_per_epoch:
                        # One sync per window (and in a distributed job one all-reduce: the mean over ranks).
                        mean_loss = distributed.mean_over_ranks(window_loss).item() / (window_steps * accumulate)
                        if not math.isfinite(mean_loss):
                            raise NonFiniteLossError(
                                f"the loss became {mean_loss} between optimizer steps {step - window_steps + 1} and {step} "
                                f"(epoch {epoch + 1}, precision={precision.name}, lr={lr}). Try a lower lr, more warm-up, "
                                "gradient clipping (clip=1.0), or bf16-mixed instead of fp16-mixed (or loss scaling if you "
                                "scale by hand)."
                            )
                        elapsed = time.perf_counter() - window_started
                        row = {
                            "step": step, "epoch": epoch + 1, "loss": mean_loss,
                            "lr": optimizer.param_groups[0]["lr"], "step_time": elapsed / window_steps,
                            "images_per_second": window_images * distributed.world_size() / elapsed,
                        }  # fmt: skip
                        history.steps.append(row)
                        bar.update(window_steps, row, history)
                        window_loss.zero_()
                        window_steps, window_images = 0, 0
                        window_started = time.perf_counter()
                    if step >= total_steps:
                        break
                epoch_loss, epoch_correct, epoch_seen = distributed.sum_over_ranks(
                    epoch_loss, epoch_correct, epoch_seen
                )
                phase = "evaluation"
                seen = max(epoch_seen, 1)
                row = {
                    "epoch": epoch + 1,
                    "train_loss": epoch_loss.item() / seen,
                    "train_accuracy": epoch_correct.item() / seen,
                    "eval_loss": None,
                    "eval_accuracy": None,
                    "peak_memory": torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
                    "seconds": time.perf_counter() - epoch_started,  # training only, evaluation excluded
                }
                if eval_data is not None:
                    result = evaluate(
                        model,
                        eval_data,
                        precision=precision,
                        device=device,
                        channels_last=channels_last,
                        loss_fn=loss_fn,
                    )
                    row["eval_loss"], row["eval_accuracy"] = result["loss"], result["accuracy"]
                history.epochs.append(row)
                bar.epoch_done(history)
                if checkpoint:
                    if distributed.is_main():  # one writer: every rank holds the same state
                        checkpoint.save(epoch + 1, model, optimizer, scheduler, precision, history)
                    distributed.barrier()  # no rank runs ahead of a checkpoint that is not yet complete
    except torch.OutOfMemoryError as error:
        # Read the numbers now; keep no reference to `error`, whose traceback holds the step's tensors.
        out_of_memory = out_of_memory_error(
            error, phase, device, batch_size=loader.batch_size, accumulate=accumulate, precision=precision.name
        )
    finally:
        bar.close()
        history.skipped_steps = precision.skipped_steps
        history.seconds += time.perf_counter() - started
    if out_of_memory is not None:
        # The raised error's traceback keeps this frame, and so these variables, alive: drop what
        # this call allocated so that the notebook kernel can go on without a restart.
        images = labels = logits = loss = optimizer = scheduler = loader = forward = parallel = None
        model.zero_grad(set_to_none=True)
        free_memory(device)
        raise out_of_memory
    return history


# ---------------------------------------------------------------------------------------------
# Checkpoints


def save_atomic(state: dict, path: str | Path) -> None:
    """torch.save to a temporary file in the same folder, then rename over `path`.

    A crash mid-write leaves the previous file intact: rename is atomic on POSIX and Windows.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


class _Checkpointer:
    """Saves `last.pt` in a folder after every epoch and resumes from it."""

    def __init__(self, directory: str | Path, plan: dict):
        self.path = Path(directory) / "last.pt"
        self.plan = plan  # what the run looks like: a resume must plan the same steps

    def save(self, epoch, model, optimizer, scheduler, precision, history) -> None:
        save_atomic(
            {
                "epoch": epoch,
                "plan": self.plan,
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "precision": precision.state_dict(),
                "history": {"steps": history.steps, "epochs": history.epochs, "seconds": history.seconds},
                "rng": torch.get_rng_state(),
            },
            self.path,
        )

    def resume(self, model, optimizer, scheduler, precision, history) -> int:
        if distributed.is_sharded(model):
            raise ValueError(
                "checkpoint_dir does not support FSDP2-sharded models; save those with torch.distributed.checkpoint."
            )
        if not self.path.exists():
            return 0
        try:
            state = torch.load(self.path, map_location="cpu", weights_only=True)
            if state["plan"] != self.plan:
                raise ValueError(
                    f"it was written by a run planned as {state['plan']}, but this call plans {self.plan}; "
                    "resume with the same epochs, batch_size, accumulate, max_steps and number of processes"
                )
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            precision.load_state_dict(state["precision"])
        except (RuntimeError, KeyError, EOFError, ValueError, pickle.UnpicklingError) as error:
            raise CheckpointError(
                f"cannot resume from {self.path}: {error}. It was written by another model, optimizer or "
                "precision, or is damaged; pass a new checkpoint_dir, or delete the file to start afresh."
            ) from error
        history.steps, history.epochs = state["history"]["steps"], state["history"]["epochs"]
        history.seconds = state["history"]["seconds"]
        torch.set_rng_state(state["rng"])
        return state["epoch"]
