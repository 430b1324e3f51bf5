"""`fit()`: the hand-written PyTorch training loop, for any model and any batch form (gpukit.step).

It reads as its algorithm, one screen each:

    fit          check every argument and build the run (`_Run`) before any work, then train it;
    _train       the epochs, and what to do when the device runs out of memory;
    _train_epoch the batches of one epoch: a micro-step each, an optimizer step every `accumulate`;
    _end_epoch   sum over ranks, evaluate, record, save.

Features are objects that do nothing when off (precision, DDP's no_sync, the monitor, the progress bar,
the TensorBoard log, saving). It never synchronises the host with the device per step: the running loss,
accuracy, metrics and token counts stay on the device and are read every `log_every` steps.
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import partial, wraps
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import tree_map

from .. import distributed
from .. import fp8 as float8
from ..env import resolve_device
from ..hardware.monitor import Monitor
from ..memory.allocator import free_memory, out_of_memory_error, watch_out_of_memory
from ..optim import SCHEDULES, check_lr, default_lr, make_optimizer, make_schedule
from ..precision import Precision, get_precision
from ..runfile import run_environment
from ..step import Batch, BatchError, Loss, TrainStep, loss_parts
from ..validation import check_int, check_number
from ..widgets import Progress
from .checkpoint import Checkpointer, warn_if_order_cannot_be_saved
from .checks import (
    NonFiniteLossError,
    check_arguments,
    check_eval_data,
    check_finite_inputs,
    check_first_batch,
    check_host_targets,
    describe,
    explained_model_failure,
    failed_batch_cause,
    warn_if_scalars_ignored,
)
from .data import as_loader, batch_on_device, batches, exact_device, length
from .evaluation import evaluate
from .history import History
from .model_options import ModelOptions, check_model_options
from .tally import RunningSums, Tally, callers_stacklevel, check_metrics, check_shifted_labels
from .tensorboard_log import open_log


def _noted_if_interrupted_before_training(fit_function: Callable) -> Callable:
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


@_noted_if_interrupted_before_training
def fit(
    model: nn.Module,
    train_data,
    *,
    epochs: int = 1,
    batch_size: int | None = None,
    lr: float | None = None,
    optimizer: str | torch.optim.Optimizer | Callable = "nesterov",
    weight_decay: float = 5e-4,
    schedule: str = "onecycle",
    warmup: float = 0.2,
    warmup_steps: int | None = None,
    precision: str | Precision = "fp32",
    accumulate: int = 1,
    clip: float | None = None,
    channels_last: bool = False,
    compile: bool | str | dict = False,
    activation_checkpointing: str | None = None,
    offload_activations: bool = False,
    fp8=False,
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
    save_every: int | None = None,
    log_dir: str | Path | None = None,
    seed: int | None = 0,
    monitor: bool | Monitor = False,
    save_in_background: bool = False,
    shifted_labels: bool | None = None,
) -> History:
    """Train `model` on `train_data` and return the History of what was measured.

    train_data: a Dataset (an ImageDataset gets the device-resident DeviceLoader, a TokenDataset
        the TextLoader), a DataLoader, a device-resident loader, or any re-iterable of batches
        (len() optional). Batches and model outputs of any form in gpukit.step: (inputs, target),
        dict batches for model(**batch), (images, targets) with targets a list of dicts for
        model(images, targets) (torchvision's detectors); outputs a tensor, a tuple, a dict (a dict of
        scalar losses is summed, each logged as a column) or a Hugging Face-style object.
    epochs, max_steps: passes over the data, and an optional cap on optimizer steps (needed for
        data without len() unless the schedule is constant).
    batch_size: the micro-batch, for a Dataset (a loader brings its own). Every sample is trained on: a last
        partial batch is kept (150 samples at 32: 5 steps per epoch, the last of 22), except a last batch of a
        single sample, which BatchNorm cannot train on (gk.data.loaders.loader_for). `accumulate=k` sums
        gradients over k micro-batches before each optimizer step, which equals one k-times larger
        batch for models without BatchNorm. The schedule counts optimizer steps.
    optimizer: a name from gpukit.optim.OPTIMIZERS ("nesterov": SGD with Nesterov momentum 0.9; "adamw",
        "lamb", "lars" and "muon" do not decay 1-D parameters), an Optimizer, or a function of
        the parameters; weight_decay applies to optimizers built by name.
    lr: the schedule's peak (default per name, gpukit.optim.DEFAULT_LRS: 0.05 for SGD, 1e-3 for
        AdamW); an Optimizer or a function you pass keeps its own learning rates unless you also
        pass lr.
    schedule, warmup, warmup_steps: "onecycle" (default), "linear" or "constant"; the
        learning rate warms up over a fraction `warmup` of the steps, or over `warmup_steps` steps
        when given (data without len() has only steps to count).
    precision: "fp32", "tf32", "bf16-mixed", "fp16-mixed" (with dynamic loss scaling) or a Precision.
    clip: a bound on the gradients' global norm, or None.
    channels_last, compile: the channels_last memory layout for 4-D image batches and weights;
        torch.compile with its defaults (True or "whole") or with a dict of its options, of each repeated
        block ("regional": compiles in about the time of one block), or with CUDA graphs ("reduce-overhead").
    activation_checkpointing, offload_activations: "full" or "selective" activation checkpointing of every
        block (gk.memory.apply_activation_checkpointing; selective keeps matmul and attention outputs); saved
        activations kept in host memory on a GPU (gk.memory.offload). Both are undone when fit returns.
    fp8: True trains every plain nn.Linear whose dimensions are multiples of 16 with FP8 matmuls (torchao's
        Float8Linear, tensorwise scales; the `fp8` extra), converted before compiling and back to nn.Linear when fit
        returns; `precision` ("bf16-mixed", as torchao trains) runs the rest. Needs FP8 tensor cores (compute
        capability 8.9: L4, H100 and newer), and pays only on large matmuls with compile (gk.fp8.compare_speed). A
        torchao Float8LinearConfig picks another recipe; Float8LinearConfig(emulate=True) runs on any device.
    device: where to train (default: this process's device in a distributed job, else the best here).
    eval_data, loss_fn, label_smoothing, metrics: held-out data evaluated after every epoch; your
        function of (outputs, target), which gets the outputs exactly as the model returned them (a
        tuple, a dict, a ModelOutput, a tensor), or "cross_entropy", "mse" or a PyTorch loss (e.g.
        nn.CrossEntropyLoss()), which get the prediction (default the model's own `loss` if it
        returns one, else cross-entropy of the prediction for integer targets); smoothing for
        cross-entropy in training only; {name: fn(outputs, target) -> number}, outputs as returned,
        averaged over samples per epoch as columns train_<name> and eval_<name>. The prediction is
        the tensor returned, else `logits`, else `out` (torchvision segmentation), else a tuple's
        first tensor. Accuracy is added where it means something: integer targets and a prediction
        of their shape plus a class dimension ((B, C) for (B,), (B, T, C) for (B, T), (B, C, H, W)
        for (B, H, W)); not with a model's own loss over sequences (it may shift its labels), nor
        from a tuple that your own loss_fn gets (a VAE's reconstruction is no class scores). eval_data's
        first batch, the loss and the metrics are tried before the first step (gpukit.train.checks).
        Scalar tensors the model returns beside its prediction ((logits, aux_loss)) are not in a
        loss computed from the prediction: a warning at the first step names the loss_fn that adds them.
    progress, live_plot, log_every: a progress bar (and live curves) in the notebook; a History
        row every log_every optimizer steps (one host-device synchronisation each).
    checkpoint_dir, save_every: the run is saved there (atomically, with a checksum) after every epoch,
        and also every `save_every` optimizer steps (counted as log_every counts them); a later call with the
        same folder resumes where the last save was, bit-equal to a run never stopped: the data's order and
        place in the epoch and every random generator (torch, CUDA, NumPy, Python) are saved. A call that
        changes the lr or another setting that shapes the run is refused, naming it. A finished run called
        again with more epochs (or max_steps) goes on: weights and optimizer state carry on, and a new
        schedule of this call's kind and lr spans the added steps (a warning says so). Stopped before its first save
        (Ctrl-C, an error), fit puts the model and optimizer back as it found them (a host copy of their state, kept
        until that save): the same call again, with the same objects, ends as a run never stopped. A file, or a folder
        that cannot be written, is refused before any work. save_in_background=True writes each save in a
        thread: training waits only for a copy of the state in host memory (gpukit.train.async_checkpoint).
    log_dir: a folder (one per run) for TensorBoard scalars of every logged step and epoch (the
        History's columns); needs the `log` extra (pip install 'gpukit[log]').
    seed: what fit draws: the order of the loader fit builds for a Dataset, and torch's global generator
        (the CPU's and every CUDA device's), seeded with seed + rank once every check has passed (a refused
        call changes no generator), from which dropout and any other random op in the model draw: two fits
        from the same weights with the same seed end equal. Not seeded by it: the model's initial weights (seed before building it, e.g.
        gk.seed_everything), the order of a loader you pass (its own seed; a DataLoader without a
        generator draws from torch's global one, so follows seed), NumPy's and Python's generators.
        Every call with an integer seed starts the generator afresh: a loop that calls fit again and again (an RL
        loop, one fit per iteration) would draw the same dropout masks and data order each time. seed=None leaves
        the generators alone: dropout draws on from where torch's global generator is, and the order of the loader
        fit builds is drawn from it (one draw per call, made even by a call refused later): seed once
        (gk.seed_everything) and each call draws anew, the whole loop reproducible. Not with checkpoint_dir, whose
        resumed run must replay the order.
    shifted_labels: for token sequences ((B, T) integer targets), whether tokens (tokens_per_second, evaluation)
        are counted from labels[:, 1:], as a causal LM's own loss scores them when it shifts its labels inside
        (Hugging Face's: T - 1 a sequence); None measures it at the first batch and warns where it cannot tell, as
        gk.evaluate does. History.shifted_labels says which was counted.
    monitor: True (or a gk.hardware.Monitor, e.g. with your grid intensity) samples the GPU at
        10 Hz and adds to each epoch energy_j, joules_per_sample, co2_grams, mean_power_w,
        mean_utilization and throttle_reasons (on a CPU: RAPL energy where readable); the samples
        are History.monitor. Where nothing can be measured it says so in one line and adds nothing.
    """
    _check_arguments(epochs, accumulate, clip, lr, log_every, schedule, max_steps, shifted_labels)
    check_model_options(activation_checkpointing, compile, offload_activations, save_in_background, checkpoint_dir)
    order_seed = _order_seed(seed)
    warmup = _warmup(warmup, warmup_steps)
    device = resolve_device(device if device is not None else distributed.default_device())
    precision = get_precision(precision, device)  # raises before any work if unsupported here
    fp8_config = float8.training_config(fp8, device)  # raises before any work without torchao or FP8 tensor cores
    _check_model(model)
    if fp8_config is not None:
        float8.convertible(model)  # a model without a Linear layer FP8 can run is refused here, before any work
    check_arguments(model, seed=seed, checkpoint_dir=checkpoint_dir, optimizer=optimizer)
    loss, metrics = Loss(loss_fn, label_smoothing), check_metrics(metrics)
    loader = _training_loader(train_data, batch_size, device, epochs, channels_last, order_seed)
    steps_per_epoch, total_steps = _count_steps(loader, accumulate, epochs, max_steps, schedule, warmup)
    _move_model(model, device, channels_last)
    check_eval_data(model, eval_data, epochs=epochs, device=device, precision=precision, channels_last=channels_last,
                    loss_fn=loss_fn, metrics=metrics)  # fmt: skip
    built, peak_lr = _optimizer(model, optimizer, lr, weight_decay)
    options = ModelOptions(model, device, activation_checkpointing, compile, offload_activations, fp8_config)
    parallel = distributed.prepare(model)  # DDP in a distributed job, else the model itself
    forward = options.forward(parallel)  # compiled and offloading, if asked
    run = _Run(
        model=model,
        device=device,
        precision=precision,
        loss=loss,
        metrics=metrics,
        loader=loader,
        parallel=parallel,
        step=TrainStep(
            forward, built, precision, loss, parameters=model.parameters(), accumulate=accumulate, clip=clip
        ),
        scheduler=make_schedule(built, schedule, total_steps, warmup),
        peak_lr=peak_lr,
        steps_per_epoch=steps_per_epoch,
        total_steps=total_steps,
        log_every=log_every,
        channels_last=channels_last,
        eval_data=eval_data,
        micro_batch_size=getattr(loader, "batch_size", None),
        eval_loss=Loss(loss_fn) if label_smoothing else loss,  # held-out loss without smoothing
        hold_predictions=options.predictions_can_wait,
        shifted_labels=shifted_labels,
        history=History(precision=precision.name, device=str(device), environment=run_environment(device)),
    )
    settings = _settings(run, optimizer, schedule, warmup, clip, label_smoothing, seed, fp8_config)
    del loader, built, parallel, forward  # the run holds them: an out-of-memory error releases the run whole
    try:
        run.resume_from(checkpoint_dir, save_every, settings, partial(make_schedule, schedule=schedule, warmup=warmup))
        if save_in_background:
            options.save_in_background(run.checkpoint)
        run.start_reporting(log_dir, progress, live_plot, monitor)
        # Dropout's draws, each rank its own. Seeded after the last check: a refused call leaves every generator (CPU
        # and CUDA) as it was; a resumed run restores the saved generators over this at its first epoch.
        if seed is not None:
            torch.manual_seed(seed + distributed.rank())
        return _train(run, epochs)
    finally:
        run.finish(options)  # the last save on disk, the folder let go; the model without compiled blocks


def _move_model(model: nn.Module, device: torch.device, channels_last: bool) -> None:
    """The model onto `device`, its 4-D weights channels_last if asked. Two calls: `to` with a memory format (even
    preserve_format) reads every parameter's dim(), which a lazy module's uninitialised parameters refuse."""
    model.to(device)
    if channels_last:
        model.to(memory_format=torch.channels_last)


def _order_seed(seed: int | None) -> int:
    """The seed of the data order of the loader fit builds: `seed`, or with seed=None a draw from torch's generator."""
    if seed is None:
        return int(torch.randint(2**31, ()))
    return check_int("seed", seed, minimum=0)


def _settings(run: _Run, optimizer, schedule, warmup, clip, label_smoothing, seed, fp8_config) -> dict:
    """The hyper-parameters saved with each checkpoint: resuming with others is refused (the Checkpointer), except
    lr, schedule and warmup when a finished run is extended. `optimizer`: as fit was given it."""
    settings = {
        "lr": run.peak_lr,
        "optimizer": optimizer if isinstance(optimizer, str) else type(run.step.optimizer).__name__,
        "schedule": schedule,
        "warmup": warmup,
        "clip": clip,
        "precision": run.precision.name,
        "label_smoothing": label_smoothing,
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


def _warmup(warmup, warmup_steps) -> float:
    """What the schedule warms up over: a fraction of the steps (< 1), or a number of steps (>= 1)."""
    if warmup_steps is not None:
        return check_int("warmup_steps", warmup_steps, minimum=0)
    check_number("warmup", warmup, positive=False, note="(a fraction of the steps; warmup_steps=N for steps)")
    if warmup >= 1:
        warnings.warn(
            f"warmup={warmup!r} as a number of steps is deprecated: pass warmup_steps={int(warmup)} "
            "(warmup is the fraction of the steps, below 1).",
            DeprecationWarning,
            stacklevel=callers_stacklevel(),  # the line of yours that called fit
        )
    return warmup


def _check_model(model) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to train, got {type(model).__name__}.")
    if not any(True for _ in model.parameters()):
        raise ValueError("the model has no parameters to train.")


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


@dataclass(eq=False)
class _Run:
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
    initial: dict | None = None  # with a checkpoint_dir, until its first save: the state fit began from, on the host
    started: float = field(default_factory=time.perf_counter)

    @property
    def accumulate(self) -> int:
        return self.step.accumulate

    def done(self) -> bool:
        return self.total_steps is not None and self.step_index >= self.total_steps

    def resume_from(self, checkpoint_dir, save_every: int | None, settings: dict, build_schedule) -> None:
        if checkpoint_dir is None:
            if save_every is not None:
                raise ValueError(f"save_every={save_every!r} saves into checkpoint_dir: pass checkpoint_dir too.")
            return
        if save_every is not None:
            check_int("save_every", save_every, note="(optimizer steps between saves)")
        plan = {
            "total_steps": self.total_steps,
            "steps_per_epoch": self.steps_per_epoch,
            "batch_size": getattr(self.loader, "batch_size", None),
            "accumulate": self.accumulate,
            "world_size": distributed.world_size(),
        }
        self.save_every = save_every
        self.checkpoint = Checkpointer(checkpoint_dir, plan, settings, save_every=save_every, device=self.device)
        self.checkpoint.hold()  # refused here if another live run trains in this folder
        self.start_epoch, self.step_index = self.checkpoint.resume(self, build_schedule)
        if not self.checkpoint.holds_a_save():
            self.keep_initial_state()
        warn_if_order_cannot_be_saved(self.loader)
        distributed.check_same(self.start_epoch, "the epoch to resume from")

    def start_reporting(self, log_dir, progress: bool, live_plot: bool, monitor: bool | Monitor) -> None:
        """The TensorBoard log, the progress bar and the monitor: one of each per job, on its first rank."""
        main = distributed.is_main()
        self.board = open_log(log_dir if main else None)  # fails before training if the folder is unusable
        self.bar = Progress(
            total=self.total_steps, initial=self.step_index, enabled=progress and main, live_plot=live_plot
        )
        self.watcher = _start_monitor(monitor, self.device)
        if self.device.type == "cuda":
            watch_out_of_memory()  # so that an out-of-memory error can say how much was asked for

    def target_check(self) -> Callable | None:
        """On a GPU, each batch's class targets checked on the host before their copy (check_host_targets)."""
        if self.device.type == "cpu":
            return None  # an out-of-range target is an IndexError here, which the loss explains
        return partial(check_host_targets, loss=self.loss, device=self.device, epoch=self.epoch)

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

    def finish(self, options: ModelOptions) -> None:
        """However fit ends: the save in flight on disk (or its failure named with the save kept), the folder let go,
        the model as it came."""
        try:
            if self.checkpoint is not None:
                self.checkpoint.let_go()
        finally:
            options.undo()

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


def _train(run: _Run, epochs: int) -> History:
    """Every epoch; an out-of-memory error frees what the run held, then says where it ran out and what to try."""
    error = None
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
        finally:
            run.close()  # (inside the outer try: Ctrl-C as the bar closes gets the note too)
    except torch.OutOfMemoryError as out_of_memory:
        # Read the numbers now; keep no reference to the original error, whose traceback holds the step's tensors.
        error = out_of_memory_error(
            out_of_memory,
            run.phase,
            run.device,
            batch_size=run.micro_batch_size or 0,
            accumulate=run.accumulate,
            precision=run.precision.name,
        )
    except BaseException as stopped:  # KeyboardInterrupt too: the model as of its last optimizer step, and where
        run.model.zero_grad(set_to_none=True)  # (the unfinished step's gradients would go into the next fit's first)
        run.put_back_if_unsaved()
        stopped.add_note(run.how_far())
        stopped.noted_by_fit = True
        raise
    if error is None:
        return run.history
    run.release()
    # A frame whose local holds the error it raises is a cycle (error -> traceback -> this frame -> local ->
    # error) that keeps the model alive until gc runs: drop the local first.
    try:
        raise error
    finally:
        del error


def _train_epoch(run: _Run, epoch: int) -> tuple[Tally, float]:
    """One pass over this rank's data: returns its tally and the seconds it took (evaluation excluded)."""
    loader = run.loader
    if hasattr(loader, "set_epoch"):
        loader.set_epoch(epoch)
    elif hasattr(getattr(loader, "sampler", None), "set_epoch"):
        loader.sampler.set_epoch(epoch)
    started = time.perf_counter()
    if run.watcher is not None:
        run.watcher.lap()  # the epoch's segment starts here: the previous evaluation is not in it
    if run.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(run.device)
    tally = Tally(run.device, run.loss, run.metrics, run.hold_predictions, run.shifted_labels)
    window = _Window(run.device)
    if run.checkpoint is None:
        epoch_batches, micro = batches(loader, run.device, check=run.target_check()), 0
    else:  # after a resume: the epoch's order replayed, and the micro-batches trained on before the save
        epoch_batches, micro = run.checkpoint.start_epoch(run, tally, window)
    batch = None  # a resumed epoch saved at its end (a kill during its evaluation) reads no batch
    device, accumulate = exact_device(run.device), run.accumulate  # looked up once, not per batch
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
            if run.save_every and run.step_index % run.save_every == 0:
                run.checkpoint.save(run, epoch, micro, tally, window)
                run.initial = None  # a resume from that save is exact now
    if micro % accumulate:  # data without len(): drop the gradients of the last, incomplete step
        run.step.optimizer.zero_grad(set_to_none=True)
    if micro == 0:
        raise ValueError(
            f"the training data gave no batch in epoch {epoch + 1}; a generator or iterator can be read "
            "only once: pass a list, a Dataset or a DataLoader."
        )
    if window.steps:
        _log(run, window, epoch, batch)
    return tally, time.perf_counter() - started


def _train_on(run: _Run, batch: Batch, number: int, epoch: int, last: bool, tally: Tally, window: _Window) -> None:
    """A micro-step on the epoch's batch `number` (from 1); a failure whose cause its data shows is said with
    that batch's number, any other gets the number as a note. Nothing here reads the device. A first batch refused
    leaves the model's buffers (BatchNorm's statistics, which its forward moved) as they were: a refused call
    changes nothing of the model."""
    kept = None if run.seen_a_batch else [(buffer, buffer.clone()) for buffer in run.model.buffers()]
    try:
        if batch.size == 0:  # known on the host, from the shape: no kernel
            raise BatchError(
                "it holds 0 samples, whose mean loss is 0/0 = NaN, which would make the weights NaN. Leave empty "
                "batches out (a sampler, collate_fn or filter that can yield one)."
            )
        if not run.seen_a_batch:
            _first_batch(run, batch)
        _micro_step(run, batch, last, tally, window)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        with torch.no_grad():
            for buffer, value in kept or ():
                buffer.copy_(value)
        cause = failed_batch_cause(error, run.model, batch)
        if cause is None:
            error.add_note(f"It failed on batch {number} of epoch {epoch + 1}: {describe(batch)}.")
            raise
        raise BatchError(f"batch {number} of epoch {epoch + 1} ({describe(batch)}): {cause}") from error


def _first_batch(run: _Run, batch: Batch) -> None:
    """What a sample is, and how many a step takes, read from the data itself."""
    run.seen_a_batch = True
    run.micro_batch_size = run.micro_batch_size or batch.size
    run.history.micro_batch_size = run.micro_batch_size
    run.history.global_batch_size = run.micro_batch_size * run.accumulate * distributed.world_size()
    run.history.sample_name = batch.sample_name
    check_first_batch(run.model, batch, run.precision, run.device)  # inputs of another dtype than the weights, named
    if run.channels_last and not any(t.dim() == 4 and t.is_floating_point() for t in batch.tensors()):
        warnings.warn(
            "channels_last=True applies to 4-D image batches; these inputs have none, so "
            "only the model's 4-D weights were converted.",
            stacklevel=callers_stacklevel(),  # the line that called fit
        )


def _micro_step(run: _Run, batch: Batch, last: bool, tally: Tally, window: _Window) -> None:
    """Forward and backward of one micro-batch; gradients stay local (no all-reduce) until the step's last."""
    run.phase = "forward"
    explain = None if run.seen_outputs else explained_model_failure(run.model, batch)  # the first batch's call
    with distributed.no_sync(run.parallel, not last):
        loss, outputs, _ = run.step.forward(batch, explain)
        run.phase = "backward"
        run.step.backward(loss)
    if not run.seen_outputs:
        run.seen_outputs = True
        warn_if_scalars_ignored(run.loss, outputs)
    loss = loss.detach()  # once for both: each keeps it until its sums are added
    tokens = tally.add(batch, loss, outputs)
    run.shifted_labels = tally.shifted_labels  # decided at the first sequence batch: kept for the whole run
    window.add(batch, loss, {} if type(outputs) is torch.Tensor else loss_parts(outputs), tokens)
    run.phase = "loading data"


def _optimizer_step(run: _Run, window: _Window, epoch: int, batch: Batch) -> None:
    run.phase = "optimizer step"
    window.lrs = [group["lr"] for group in run.step.optimizer.param_groups]  # this step's: the schedule moves on next
    run.step.step()
    run.step_index += 1  # the weights hold it now (what an interrupted fit's note says), the schedule steps next
    run.phase = "loading data"
    run.scheduler.step()
    window.steps += 1
    if window.steps == run.log_every or run.step_index == run.total_steps:
        _log(run, window, epoch, batch)


def _end_epoch(run: _Run, epoch: int, tally: Tally, seconds: float) -> None:
    """Sum the epoch over ranks, evaluate, record the row, and save the run."""
    tally.over_ranks()  # one all-reduce
    run.hold_predictions = run.hold_predictions and not tally.uncounted  # targets written in place: count at once
    energy = _epoch_energy(run.watcher, tally.samples) if run.watcher is not None else {}
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
        run.checkpoint.save(run, epoch + 1)
        run.initial = None  # a resume from that save is exact now


class _Window:
    """Sums over the optimizer steps between two log points, kept on the device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.sums = RunningSums(self.device, ["loss", "tokens"])
        self.sequences = False
        self.micro_batches = self.samples = self.steps = 0
        self.lrs: list[float] = []  # each parameter group's lr that the window's last step trained with
        self.started = time.perf_counter()

    def add(self, batch: Batch, loss: torch.Tensor, parts: dict[str, torch.Tensor], tokens: torch.Tensor | None):
        """One micro-batch's loss, and the model's own losses when it returns a dict of them (a column each);
        for sequence data its scored tokens (Tally.add's count: from labels[:, 1:] where the loss shifts them)."""
        self.sums.defer("loss", loss)  # no kernel now: added when the row is read (RunningSums.defer)
        for name, part in parts.items():
            self.sums.defer(name, part)
        self.micro_batches += 1
        self.samples += batch.size
        if tokens is not None:
            self.sequences = True
            self.sums.defer("tokens", tokens)

    def row(self, step: int, epoch: int, lrs: list[float]) -> dict:
        """One History.steps row: one synchronisation (and in a distributed job one all-reduce)."""
        self.sums.over_ranks()
        sums, ranks = self.sums.read(), distributed.world_size()
        elapsed = time.perf_counter() - self.started  # after the synchronisation: the GPU's work is done
        mean = {name: value / (ranks * self.micro_batches) for name, value in sums.items() if name != "tokens"}
        row = {
            "step": step,
            "epoch": epoch,
            **mean,  # the loss, then each of the model's own losses (a dict of them)
            **_lr_columns(lrs),
            "step_time": elapsed / self.steps,
            "samples_per_second": self.samples * ranks / elapsed,
        }
        if self.sequences:
            row["tokens_per_second"] = sums["tokens"] / elapsed
        return row


def _lr_columns(lrs: list[float]) -> dict[str, float]:
    """lr (the first parameter group's), then lr_group1, lr_group2, ... for the others where the groups' lrs differ."""
    columns = {"lr": lrs[0]}
    if len(set(lrs)) > 1:
        columns |= {f"lr_group{index}": lr for index, lr in enumerate(lrs[1:], start=1)}
    return columns


def _log(run: _Run, window: _Window, epoch: int, batch: Batch | None = None) -> None:
    # A window resumed from a file saved before windows kept their lrs has none: the optimizer's now is the nearest.
    lrs = window.lrs or [group["lr"] for group in run.step.optimizer.param_groups]
    row = window.row(run.step_index, epoch + 1, lrs)
    if not math.isfinite(row["loss"]):
        check_finite_inputs(batch, run.step_index, epoch, run.loss.ignore_index)  # named as a data problem
        raise NonFiniteLossError(
            f"the loss became {row['loss']} between optimizer steps {run.step_index - window.steps + 1} and "
            f"{run.step_index} (epoch {epoch + 1}, precision={run.precision.name}, peak lr={run.peak_lr:g}). Try a "
            "lower lr, more warm-up, gradient clipping (clip=1.0), or bf16-mixed instead of fp16-mixed (or loss "
            "scaling if you scale by hand). The last batch read holds no NaN or inf and scores at least one target "
            "(log_every=1 checks the batch of every step)."
            + (f" Nothing non-finite was saved: {run.checkpoint.last_good_save()}." if run.checkpoint else "")
        )
    run.history.steps.append(row)
    run.board.add_step(row)
    run.bar.update(window.steps, row, run.history)
    window.reset()


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
