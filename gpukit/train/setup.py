"""fit's setup: every check first, then the run built (a `Run`: gpukit.train.run) and begun.

The checks, in order: the numbers (epochs, accumulate, clip, lr, log_every, schedule, max_steps), the data order's seed,
the device and the precision on it (and FP8 there), the model (gpukit.train.checks: trainable, an optimizer of its own
parameters, a folder that can hold its saves), TensorBoard's log_dir, the loss and metrics, the training data (a loader that gives batches,
and the steps it makes), eval_data's first batch through the model (moved to the device for it), and the optimizer's
learning rates. Then building: the model transforms (gpukit.train.model_options), the data-parallel wrapper, the
TrainStep, the schedule and the History; then resuming from the last save and starting the reports, and at last
torch's generator seeded: a call refused by any check has drawn nothing from it.
"""

from __future__ import annotations

import numbers
import os
import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from torch import nn

from .. import distributed
from .. import fp8 as float8
from ..env import resolve_device
from ..optim import SCHEDULES, check_lr, default_lr, make_optimizer, make_schedule
from ..precision import get_precision
from ..runfile import run_environment
from ..step import Loss, TrainStep
from ..validation import check_int, check_number, check_seed
from .checks import check_arguments, check_eval_data
from .data import as_loader, length
from .history import History
from .model_options import ModelOptions
from .options import ModelTransforms, Reporting, Saving
from .run import Run
from .tally import callers_stacklevel, check_metrics, check_shifted_labels
from .tensorboard_log import check_log_folder


def start_run(
    model: nn.Module,
    train_data,
    *,
    epochs,
    max_steps,
    batch_size,
    accumulate,
    optimizer,
    lr,
    weight_decay,
    schedule,
    warmup,
    clip,
    loss_fn,
    eval_data,
    metrics,
    shifted_labels,
    device,
    precision,
    seed,
    saving: Saving,
    transforms: ModelTransforms,
    progress,
    log_every,
    reporting: Reporting,
) -> Run:
    """fit's arguments checked, then the run built and begun; a failure after the model's transforms leaves the model
    as it came (Run.finish)."""
    started = time.perf_counter()  # History.seconds: the whole call, its checks and building too
    saving, reporting = _absolute(saving, "folder"), _absolute(reporting, "log_dir")
    _check_arguments(epochs, accumulate, clip, lr, log_every, schedule, max_steps, shifted_labels)
    order_seed = _order_seed(seed)
    warmup = _warmup(warmup)
    device = resolve_device(device if device is not None else distributed.default_device())
    precision = get_precision(precision, device)  # raises before any work if unsupported here
    fp8_config = float8.training_config(transforms.fp8, device)  # raises before any work without torchao or FP8 cores
    _check_model(model, fp8_config)
    check_arguments(model, seed=seed, checkpoint_dir=saving.folder, optimizer=optimizer)
    if distributed.is_main():  # the one rank that writes TensorBoard's files
        check_log_folder(reporting.log_dir)
    loss, metrics = Loss(loss_fn), check_metrics(metrics)
    channels_last = transforms.channels_last
    loader = _training_loader(train_data, batch_size, device, epochs, channels_last, order_seed)
    steps_per_epoch, total_steps = _count_steps(loader, accumulate, epochs, max_steps, schedule, warmup)
    _move_model(model, device, channels_last)
    check_eval_data(model, eval_data, epochs=epochs, device=device, precision=precision, channels_last=channels_last,
                    loss_fn=loss_fn, metrics=metrics)  # fmt: skip
    built, peak_lr = _optimizer(model, optimizer, lr, weight_decay)
    # Every check passed: now building.
    options = ModelOptions(model, device, transforms, fp8_config)
    parallel = distributed.prepare(model)  # DDP in a distributed job, else the model itself
    forward = options.forward(parallel)  # the model compiled and offloading, if asked
    step = TrainStep(forward, built, precision, loss, parameters=model.parameters(), accumulate=accumulate, clip=clip)
    run = Run(
        model=model,
        device=device,
        precision=precision,
        loss=loss,
        metrics=metrics,
        loader=loader,
        parallel=parallel,
        step=step,
        scheduler=make_schedule(built, schedule, total_steps, warmup),
        peak_lr=peak_lr,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        log_every=log_every,
        channels_last=channels_last,
        eval_data=eval_data,
        micro_batch_size=getattr(loader, "batch_size", None),
        eval_loss=Loss(loss_fn, evaluation=True) if loss.label_smoothing else loss,  # held-out: no smoothing
        hold_predictions=options.predictions_can_wait,
        shifted_labels=shifted_labels,
        history=History(precision=precision.name, device=str(device), environment=run_environment(device)),
        options=options,
        alone=distributed.world_size() == 1,
        started=started,
    )
    settings = _settings(run, optimizer, schedule, warmup, clip, seed, fp8_config)
    del loader, built, parallel, step  # the run holds them: an out-of-memory error releases the run whole
    try:
        run.begin(saving, settings, partial(make_schedule, schedule=schedule, warmup=warmup), reporting, progress, seed)
    except BaseException:
        run.finish()  # the folder let go; the model as it came
        raise
    return run


def _absolute(options: Saving | Reporting, field: str) -> Saving | Reporting:
    """`options` with the folder in `field` made absolute as fit starts: a Dataset (or anything else) that changes the
    working folder while fit trains must not move the saves or TensorBoard's files after it elsewhere (a folder that is
    no path, or names none, is refused by its check)."""
    folder = getattr(options, field)
    if not isinstance(folder, (str, os.PathLike)) or not str(os.fspath(folder)).strip():
        return options
    return replace(options, **{field: Path(folder).absolute()})


def _move_model(model: nn.Module, device: torch.device, channels_last: bool) -> None:
    """The model onto `device`, its 4-D weights channels_last if asked. Two calls: `to` with a memory format (even
    preserve_format) reads every parameter's dim(), which a lazy module's uninitialised parameters refuse."""
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)


def _order_seed(seed: int | None) -> int:
    """The seed of the data order of the loader fit builds: `seed` (a Python or NumPy integer), or with seed=None a
    draw from torch's generator."""
    if seed is None:
        return int(torch.randint(2**31, ()))
    return check_seed(seed)  # the kit's one rule: NumPy's integers too, 0..2**32 - 1


def _settings(run: Run, optimizer, schedule, warmup, clip, seed, fp8_config) -> dict:
    """The hyper-parameters saved with each checkpoint: resuming with others is refused (the Checkpointer), except
    lr, schedule and warmup when a finished run is extended. `optimizer`: as fit was given it."""
    settings = {
        "lr": run.peak_lr,
        "optimizer": optimizer if isinstance(optimizer, str) else type(run.step.optimizer).__name__,
        "schedule": schedule,
        "warmup": warmup,
        "clip": clip,
        "precision": run.precision.name,
        "label_smoothing": run.loss.label_smoothing,  # (the key of checkpoints from before gk.CrossEntropy)
        "seed": seed,
    }
    if fp8_config is not None:  # a setting only when on: runs saved before fit had fp8 resume as they were
        settings["fp8"] = True
    return settings


def _check_arguments(epochs, accumulate, clip, lr, log_every, schedule, max_steps, shifted_labels) -> None:
    check_int("epochs", epochs, minimum=0)
    check_shifted_labels(shifted_labels)
    check_int("accumulate", accumulate, note="(micro-batches per optimizer step)")
    if clip is not None:
        check_number("clip", clip, note="(a bound on the gradients' global norm) or None")
    if lr is not None:
        check_lr(lr)
    if not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every must be an integer >= 1, got {log_every!r}.")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule={schedule!r} is unknown; use one of {', '.join(map(repr, SCHEDULES))}.")
    if max_steps is not None and (not isinstance(max_steps, int) or max_steps < 1):
        raise ValueError(f"max_steps must be a positive integer or None, got {max_steps!r}.")


def _warmup(warmup: float | int) -> float | int:
    """What the schedule warms up over: a fraction of the steps (a float below 1), or a number of steps (an int)."""
    if isinstance(warmup, numbers.Integral) and not isinstance(warmup, bool):
        return check_int("warmup", int(warmup), minimum=0, note="(an int is a number of optimizer steps)")
    check_number("warmup", warmup, positive=False, note="(a fraction of the steps below 1, or an int number of steps)")
    if warmup >= 1:
        warnings.warn(
            f"warmup={warmup!r} as a number of steps is deprecated: pass warmup={int(warmup)}, an int (a float is "
            "the fraction of the steps, below 1).",
            DeprecationWarning,
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )
    return warmup


def _check_model(model, fp8_config) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to train, got {type(model).__name__}.")
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters to train.")
    if fp8_config is not None:
        float8.convertible(model)  # a model without a Linear layer FP8 can run is refused here, before any work


def _training_loader(train_data, batch_size, device, epochs, channels_last, seed):
    """This rank's loader of the training data, refused before any work if it cannot give `epochs` passes."""
    loader = as_loader(train_data, batch_size, device, shuffle=True, channels_last=channels_last, seed=seed)
    if epochs > 1 and isinstance(loader, Iterator):  # a generator: its second epoch would be empty
        raise ValueError(
            f"the training data is a {type(loader).__name__}, which can be read only once, but epochs={epochs}; pass a "
            "list, a Dataset, a DataLoader or an object whose __iter__ starts afresh, or train one epoch."
        )
    loader = distributed.shard(loader)  # in a distributed job, this rank's part of the data
    if length(loader) == 0:
        dataset = getattr(loader, "dataset", None)
        size = f"{len(dataset)} examples" if hasattr(dataset, "__len__") else "the data"
        raise ValueError(
            f"the training data gives no batch: {size} with batch size {getattr(loader, 'batch_size', '?')} and "
            "drop_last; use a smaller batch_size or more data."
        )
    return loader


def _count_steps(loader, accumulate, epochs, max_steps, schedule, warmup) -> tuple[int | None, int | None]:
    """(optimizer steps per epoch, steps the schedule spans); None where the data has no len()."""
    batches_per_epoch = length(loader)
    if batches_per_epoch is not None:
        steps_per_epoch = max(batches_per_epoch // accumulate, 1)
        return steps_per_epoch, steps_per_epoch * epochs if max_steps is None else min(
            max_steps, steps_per_epoch * epochs
        )
    if max_steps is None and (schedule != "constant" or 0 < warmup < 1):
        raise ValueError(
            f"the training data has no len(), so fit cannot tell how many steps the {schedule!r} schedule spans: "
            "pass max_steps=N (the schedule then spans N optimizer steps), give the data a __len__ (epochs × its "
            "length sets the schedule), or use schedule='constant' with warmup in steps (warmup=0 or e.g. 100)."
        )
    return None, max_steps


def _optimizer(model: nn.Module, optimizer, lr, weight_decay) -> tuple[torch.optim.Optimizer, float]:
    """The optimizer and the schedule's peak lr: lr, else the optimizer's own (one you built), else the name's."""
    peak_lr = lr if lr is not None else default_lr(optimizer)
    built = make_optimizer(optimizer, model, peak_lr, weight_decay)
    left = [group["lr"] for group in built.param_groups]
    # An earlier fit's schedule left its lr at the end of its decay (OneCycleLR: 1/250,000 of the peak) and its peak
    # in these keys: this fit's schedule starts from the optimizer's own lr again, not from the decay.
    owns = [group.get("max_lr", group.get("initial_lr", group["lr"])) for group in built.param_groups]
    if lr is not None and not isinstance(optimizer, str) and len(set(owns)) > 1:
        raise ValueError(
            f"lr={lr:g} would set every parameter group of the optimizer to one lr, but its groups have their own "
            f"({', '.join(f'{value:g}' for value in owns)}). Leave lr out to train each group at its own lr (the "
            "schedule peaks at each), or set the groups' lrs where the optimizer is built."
        )
    for group, own in zip(built.param_groups, owns):
        for key in ("max_lr", "initial_lr", "min_lr"):
            group.pop(key, None)
        group["lr"] = peak_lr if lr is not None or isinstance(optimizer, str) else own
    if lr is None and not isinstance(optimizer, str) and left != [group["lr"] for group in built.param_groups]:
        warnings.warn(
            f"optimizer: its lr ({', '.join(f'{value:g}' for value in left)}) is where an earlier schedule left it; "
            f"this fit's schedule peaks at the lr it began with ({built.param_groups[0]['lr']:g}) again. Pass lr= to "
            "choose another.",
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )
    return built, built.param_groups[0]["lr"]
