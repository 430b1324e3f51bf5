"""fit's rarely used options, in three small groups, each checked when it is made and off (doing nothing) by default:

    ModelTransforms  what fit does to the model for the run: channels_last, compile, activation checkpointing,
                     offloading, FP8 (applied in torchtitan's order and undone when fit returns: model_options.py);
    Saving           the folder the run is saved in, how often, and whether a thread writes it (checkpoint.py);
    Reporting        what is shown and written besides the History: a live plot, TensorBoard, the hardware monitor.

`grouped` is the one place where what you pass becomes these objects: None is a group that is off, a folder path
is Saving(folder), and fit's flat keywords from before the groups (channels_last=True, checkpoint_dir="runs/a",
monitor=True, ...: OLD_KEYWORDS) still work, each folded into its group; so do two folded into another option
(RENAMED): warmup_steps=N is warmup=N (an int: steps), label_smoothing=0.1 is loss_fn=gk.CrossEntropy(0.1).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from functools import wraps

from torch.nn import functional as F

from ..compiling import COMPILE_MODES
from ..hardware.monitor import Monitor
from ..memory.activation_checkpointing import check_policy
from ..step.builtin_losses import CrossEntropy
from ..validation import check_int
from .tensorboard_log import check_log_dir


@dataclass(frozen=True)
class ModelTransforms:
    """What fit does to the model for the run, undone when fit returns. Applied in torchtitan's order: FP8, then
    activation checkpointing, then compiling, then the data-parallel wrapper (gpukit.train.model_options).

    channels_last: the channels_last memory layout for 4-D image batches and the model's 4-D weights.
    compile: torch.compile with its defaults (True or "whole") or with a dict of its options; "regional" compiles
        each repeated block (in about the time of one block); "reduce-overhead" the whole model with CUDA graphs.
    activation_checkpointing: "full" or "selective" checkpointing of every block (gk.memory.apply_activation_
        checkpointing; selective keeps matmul and attention outputs), or None.
    offload_activations: the activations saved for backward kept in host memory on a GPU (gk.memory.offload).
    fp8: True trains every plain nn.Linear whose dimensions are multiples of 16 with FP8 matmuls (torchao's
        Float8Linear, tensorwise scales; the `fp8` extra), converted before compiling and back to nn.Linear when
        fit returns; `precision` ("bf16-mixed", as torchao trains) runs the rest. Needs FP8 tensor cores (compute
        capability 8.9: L4, H100 and newer), and pays only on large matmuls with compile (gk.fp8.compare_speed). A
        torchao Float8LinearConfig picks another recipe; Float8LinearConfig(emulate=True) runs on any device.
        Checked against the device when fit starts.
    """

    channels_last: bool = False
    compile: bool | str | dict = False
    activation_checkpointing: str | None = None
    offload_activations: bool = False
    fp8: object = False  # True, False or a torchao.float8.Float8LinearConfig

    def __post_init__(self):
        if self.activation_checkpointing is not None:
            check_policy(self.activation_checkpointing)
        if not isinstance(self.compile, (bool, dict)) and self.compile not in COMPILE_MODES:
            raise ValueError(
                f"compile={self.compile!r} is unknown; use True or 'whole' (the whole model), 'regional' (each "
                "repeated block: compiles faster), 'reduce-overhead' (the whole model with CUDA graphs), or a dict of "
                "torch.compile's options."
            )
        if not isinstance(self.offload_activations, bool):
            raise TypeError(f"offload_activations must be True or False, got {self.offload_activations!r}.")


@dataclass(frozen=True)
class Saving:
    """Where the run is saved, so that a later call with the same folder resumes it (gpukit.train.checkpoint).

    folder: the run is saved there (last.pt, atomically, with a checksum) after every epoch. A later call with the
        same folder resumes where the last save was, bit-equal to a run never stopped: the data's order and place in
        the epoch and every random generator (torch, CUDA, NumPy, Python) are saved. A call that changes the lr or
        another setting that shapes the run is refused, naming it. A finished run called again with more epochs (or
        max_steps) goes on: weights and optimizer state carry on, and a new schedule of this call's kind and lr spans
        the added steps (a warning says so). Stopped before its first save (Ctrl-C, an error), fit puts the model and
        optimizer back as it found them (a host copy of their state, kept until that save): the same call again, with
        the same objects, ends as a run never stopped. A file, or a folder that cannot be written, is refused before
        any work. Needs an integer seed (the order is replayed).
    every: also save every `every` optimizer steps (counted as log_every counts them), or None.
    in_background: write each save in a thread: training waits only for a copy of the state in host memory
        (gpukit.train.async_checkpoint).

    fit(saving="runs/a") is Saving("runs/a"); checkpoint_dir=, save_every= and save_in_background= still work.
    """

    folder: str | os.PathLike | None = None
    every: int | None = None
    in_background: bool = False

    def __post_init__(self):
        if self.every is not None:
            if self.folder is None:
                raise ValueError(
                    f"save_every={self.every!r} saves into checkpoint_dir: pass checkpoint_dir too (the new spelling: "
                    f"saving=gk.Saving(folder, every={self.every!r}))."
                )
            check_int("save_every", self.every, note="(Saving.every: optimizer steps between saves)")
        if not isinstance(self.in_background, bool):
            raise TypeError(
                f"save_in_background (Saving.in_background) must be True or False, got {self.in_background!r}."
            )
        if self.in_background and self.folder is None:
            raise ValueError(
                "save_in_background=True writes fit's checkpoints in a thread: pass checkpoint_dir too (the new "
                "spelling: saving=gk.Saving(folder, in_background=True))."
            )


@dataclass(frozen=True)
class Reporting:
    """What fit shows and writes besides the History and its progress bar (gpukit.widgets, tensorboard_log.py).

    live_plot: live curves of the loss (and the held-out figures) under the progress bar, in a notebook.
    log_dir: a folder (one per run) for TensorBoard scalars of every logged step and epoch (the History's columns);
        needs the `log` extra (pip install 'gpukit[log]').
    monitor: True (or a gk.hardware.Monitor, e.g. with your grid intensity) samples the GPU at 10 Hz and adds to each
        epoch energy_j, joules_per_sample, co2_grams, mean_power_w, mean_utilization and throttle_reasons (on a CPU:
        RAPL energy where readable); the samples are History.monitor. Where nothing can be measured it says so in
        one line and adds nothing.
    """

    live_plot: bool = False
    log_dir: str | os.PathLike | None = None
    monitor: bool | Monitor = False

    def __post_init__(self):
        check_log_dir(self.log_dir)  # a path that names a folder: not 3, not ""
        if not isinstance(self.monitor, (bool, Monitor)) and self.monitor is not None:
            raise TypeError(f"monitor must be True, False or a gk.hardware.Monitor, got {self.monitor!r}.")


GROUPS = {"transforms": ModelTransforms, "saving": Saving, "reporting": Reporting}
OLD_KEYWORDS = {  # fit's flat keywords from before the groups: (group, field)
    "channels_last": ("transforms", "channels_last"),
    "compile": ("transforms", "compile"),
    "activation_checkpointing": ("transforms", "activation_checkpointing"),
    "offload_activations": ("transforms", "offload_activations"),
    "fp8": ("transforms", "fp8"),
    "checkpoint_dir": ("saving", "folder"),
    "save_every": ("saving", "every"),
    "save_in_background": ("saving", "in_background"),
    "live_plot": ("reporting", "live_plot"),
    "log_dir": ("reporting", "log_dir"),
    "monitor": ("reporting", "monitor"),
}


RENAMED = {"warmup_steps": "warmup", "label_smoothing": "loss_fn"}  # fit's keywords folded into another option


def folded(options: dict) -> dict:
    """fit's keyword arguments with warmup_steps=N as warmup=N and label_smoothing=x as loss_fn=gk.CrossEntropy(x): the
    same run, to the bit (the checkpoint's settings keep their keys)."""
    options = dict(options)
    if options.get("warmup_steps") is not None:
        if "warmup" in options:
            raise TypeError("warmup_steps and warmup name the same option: pass warmup=N only (an int: N steps).")
        options["warmup"] = check_int("warmup_steps", options["warmup_steps"], minimum=0)
    options.pop("warmup_steps", None)
    smoothing, loss_fn = options.pop("label_smoothing", 0.0), options.get("loss_fn")
    if smoothing != 0.0:  # (NaN too: CrossEntropy refuses it)
        if loss_fn is not None and loss_fn != "cross_entropy" and loss_fn is not F.cross_entropy:
            raise ValueError(
                "label_smoothing applies to the built-in cross-entropy (loss_fn=None or 'cross_entropy'); build it "
                "into your own loss_fn instead, e.g. nn.CrossEntropyLoss(label_smoothing=0.1), or pass "
                "loss_fn=gk.CrossEntropy(label_smoothing=0.1)."
            )
        options["loss_fn"] = CrossEntropy(smoothing)
    return options


def as_group(name: str, value):
    """The option group `name` of fit ("transforms", "saving" or "reporting") as its object: None is the group off,
    a folder path is Saving(folder)."""
    kind = GROUPS[name]
    if value is None:
        return kind()
    if isinstance(value, kind):
        return value
    if kind is Saving and isinstance(value, (str, os.PathLike)):
        return Saving(value)
    folder = " or a folder path" if kind is Saving else ""
    raise TypeError(f"{name} must be a gk.{kind.__name__}{folder} or None, got {value!r}.")


def grouped(options: dict) -> dict:
    """fit's keyword arguments with each group as its object (`as_group`), and the old flat keywords folded into it
    (and into their options: `folded`)."""
    options = folded(options)
    moved = {name: options.pop(name) for name in OLD_KEYWORDS if name in options}
    for group in GROUPS:
        fields = {OLD_KEYWORDS[name][1]: value for name, value in moved.items() if OLD_KEYWORDS[name][0] == group}
        if fields and options.get(group) is not None:
            old = ", ".join(name for name in moved if OLD_KEYWORDS[name][0] == group)
            raise TypeError(f"{old} and {group}= name the same options: pass them inside {group}= only.")
        options[group] = GROUPS[group](**fields) if fields else as_group(group, options.get(group))
    return options


def accepts_old_keywords(fit_function: Callable) -> Callable:
    """`fit_function` called with its option groups as objects, whatever spelling it was given (`grouped`)."""

    @wraps(fit_function)
    def with_groups(*args, **options):
        return fit_function(*args, **grouped(options))

    return with_groups
