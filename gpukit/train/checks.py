"""Mistakes found before any training time is spent, each named with what to do.

    check_arguments      the types of what is not checked elsewhere (seed), a model with something to train,
                         an optimizer you built that updates this model's parameters,
                         and a checkpoint_dir that is a folder fit can write to;
    check_eval_data      eval_data's first batch through the model (no gradients, eval mode), with the loss
                         and the metrics, before the first step: not after the first epoch has trained;
    check_first_batch    floating-point inputs of another dtype than the model's weights, named both;
    batch_problem        NaN or inf in a batch, or no target of it scored: how it makes a loss non-finite;
    explained_model_failure  around the model call on the training data's first batch: a failure says how
                         the batch was split and called, and what to pass (as eval_data's check does);

The mistakes found in the data while training (a failed step, a non-finite loss) are in batch_checks.py.

eval_data is checked with one real forward, not on the meta device or with fake tensors: those cannot run what
depends on values (a mask read with .item(), boolean indexing, Python control flow on a tensor), so they would
refuse models that train. One forward of a two-example batch costs less than one training step.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.utils._pytree import keystr, tree_flatten_with_path, tree_leaves
from torch.utils.data import Dataset

from .. import distributed
from ..precision import Precision
from ..report import format_bytes
from ..step import (
    Batch,
    Loss,
    describe_value,
    training_mode,
)
from ..validation import check_seed
from .buffers import buffers_kept
from .data import as_loader, batch_on_device
from .tally import Tally

EVAL_CHECK_EXAMPLES = 2  # examples of a Dataset's first batch that check_eval_data runs through the model


class NonFiniteLossError(FloatingPointError):
    """Training produced a NaN or infinite loss."""


class NonFiniteInputError(NonFiniteLossError, ValueError):
    """The loss became NaN or infinite and the batch holds NaN or inf: a problem in the data, not the lr."""


class FirstCallError(ValueError):
    """The model failed on the training data's first batch: how the batch was called, and the model's error as the
    cause (which the batch's data may explain: gpukit.train.batch_checks)."""


def check_arguments(model: nn.Module, *, seed, checkpoint_dir, optimizer=None) -> None:
    """What fit checks before it builds anything, besides the numbers loop.py checks."""
    if seed is None:
        if checkpoint_dir is not None:
            raise ValueError(
                "seed=None draws a new data order at each call, which a resumed run could not replay; pass an integer "
                "seed with checkpoint_dir."
            )
    else:
        check_seed(seed)  # NumPy's integers are seeds too; one range for every seed of the kit
    if checkpoint_dir is not None and distributed.is_sharded(model):
        raise ValueError(
            "checkpoint_dir does not support FSDP2-sharded models; save those with torch.distributed.checkpoint."
        )
    check_trainable(model)
    for each in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:  # (a list: one each)
        if isinstance(each, torch.optim.Optimizer):
            check_optimizer_parameters(model, each)
    if distributed.is_main():  # the one rank that writes checkpoints
        check_checkpoint_dir(checkpoint_dir)
        check_room_for_saves(model, checkpoint_dir)


def check_trainable(model: nn.Module) -> None:
    parameters = list(model.parameters())
    if parameters and not any(parameter.requires_grad for parameter in parameters):
        raise ValueError(
            f"all {len(parameters)} parameters of the model are frozen (requires_grad=False), so training would "
            "change nothing; unfreeze what should learn, e.g. model.head.requires_grad_(True)."
        )


def check_optimizer_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """An optimizer you built must update this model's own Parameters: one built for another model (a copy, an
    earlier instance) trains nothing here, and the loss would stay where it is without a word."""
    own = {id(parameter) for parameter in model.parameters()}
    updated = [parameter for group in optimizer.param_groups for parameter in group["params"]]
    foreign = [parameter for parameter in updated if id(parameter) not in own]
    if foreign:
        shapes = ", ".join(str(tuple(parameter.shape)) for parameter in foreign[:3]) + (
            ", ..." if len(foreign) > 3 else ""
        )
        raise ValueError(
            f"the optimizer updates {len(foreign)} of its {len(updated)} parameters ({shapes}) that are not this "
            f"model's, so training would not change them: build it from the model you train "
            f"({type(optimizer).__name__}(model.parameters(), ...)) or pass a name, e.g. optimizer='adamw'."
        )


def check_checkpoint_dir(checkpoint_dir, name: str = "checkpoint_dir") -> None:
    """A folder that `last.pt` can be written into, created now (as the first save would): refused before any
    work if it is a file, or cannot be created or written. `name` is what the caller calls it (a CLI flag)."""
    if checkpoint_dir is None:
        return
    if not isinstance(checkpoint_dir, (str, os.PathLike)):
        raise ValueError(
            f"{name} must be a folder path (a str or Path), got {checkpoint_dir!r} (a {type(checkpoint_dir).__name__})."
        )
    folder = Path(checkpoint_dir)
    link = _broken_link(folder)
    if link is not None:
        raise ValueError(
            f"{name} {str(folder)!r} cannot be used: {link}; point the link at an existing folder (or create the "
            "folder it names), or pass another folder path."
        )
    if folder.exists() and not folder.is_dir():
        raise ValueError(
            f"{name} {str(folder)!r} is a file, not a folder; pass a folder path (last.pt is saved inside it)."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # what a save needs: a new file in the folder
            pass
    except OSError as error:
        where = f" ({error.filename})" if error.filename and str(error.filename) != str(folder) else ""
        raise ValueError(
            f"{name} {str(folder)!r} cannot be written: {error.strerror or error}{where}; pass a folder you "
            "can write to (a part of its path that is a file, or a read-only disk, gives this)."
        ) from error


def _broken_link(folder: Path) -> str | None:
    """The first part of `folder`'s path that is a symbolic link leading nowhere (to nothing, or round in a loop),
    said for a message; None if there is none. mkdir would say only "File exists" for it."""
    for part in [*reversed(folder.parents), folder]:  # from the root down: below a broken link nothing resolves
        if not part.is_symlink():
            continue
        try:
            part.stat()
        except OSError as error:
            if error.errno == errno.ELOOP:
                return f"{part} is a symbolic link in a loop (it leads back to itself)"
            return f"{part} is a symbolic link to {os.readlink(part)}, which does not exist"
    return None


def check_room_for_saves(model: nn.Module, checkpoint_dir) -> None:
    """Refuse, before any work, a checkpoint_dir whose disk has less room than the model's weights alone: every save
    would fail (a save holds the weights and buffers, and the optimizer's state besides)."""
    if checkpoint_dir is None:
        return
    tensors = [tensor for tensor in [*model.parameters(), *model.buffers()] if not nn.parameter.is_lazy(tensor)]
    weights = sum(tensor.numel() * tensor.element_size() for tensor in tensors)  # bytes
    free = shutil.disk_usage(checkpoint_dir).free  # bytes; the folder exists (check_checkpoint_dir made it)
    if free < weights:
        raise ValueError(
            f"checkpoint_dir {str(checkpoint_dir)!r} is on a disk with {format_bytes(free)} free, and every save "
            f"needs more than the model's weights alone, {format_bytes(weights)}: free space on that disk, or pass "
            "a checkpoint_dir on another disk."
        )


def check_eval_data(
    model: nn.Module,
    eval_data,
    *,
    epochs: int,
    device: torch.device,
    precision: Precision,
    channels_last: bool,
    loss_fn,
    metrics: dict,
) -> None:
    """Run eval_data's first batch through the model, the loss and the metrics, as evaluation will after
    each epoch; a failure names eval_data and the batch, before the first training step."""
    if eval_data is None:
        return
    if isinstance(eval_data, Iterator):  # a generator: reading its first batch would take it from the evaluation
        if epochs > 1:
            raise ValueError(
                f"eval_data is a {type(eval_data).__name__}, which can be read only once, but it is evaluated after "
                f"each of the {epochs} epochs; pass a list, a Dataset or a DataLoader."
            )
        return
    with _random_state_kept(device), buffers_kept(model):  # draws (a shuffled loader, a sampling model), observers
        batch = _first_eval_batch(eval_data, device, channels_last)
        _evaluate_one(model, batch, device, precision, loss_fn, metrics)


def _evaluate_one(model: nn.Module, batch: Batch, device, precision: Precision, loss_fn, metrics: dict) -> None:
    with torch.no_grad(), training_mode(model, False):
        try:
            with precision.autocast():
                outputs = batch.call(model)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # any failure of the model on this batch: say which data it was
            raise ValueError(
                f"{model_failure(model, batch, error, 'eval_data')} Give eval_data batches of the form, shapes and "
                "dtypes of the training data's."
            ) from error
        try:
            loss = Loss(loss_fn, evaluation=True)  # its own (unsmoothed): the training loss checks its targets itself
            with precision.autocast():
                value, parts = loss.of_evaluation(outputs, batch.target)
            Tally(device, loss, metrics, shifted_labels=False).add(batch, value, outputs, parts)  # no tokens read
            problem = batch_problem(batch, loss.ignore_index) if _not_finite(value) else None
        except torch.OutOfMemoryError:
            raise
        except Exception as error:
            raise ValueError(
                f"the loss or a metric failed on eval_data's first batch ({describe(batch)}) before training "
                f"started: {_one_line(error)}"
            ) from error
        if problem is not None:  # its eval_loss would be NaN after every epoch, its accuracy counted from NaN outputs
            raise NonFiniteInputError(f"eval_data's first batch ({describe(batch)}) {problem}")


def _not_finite(value) -> bool:
    """Whether a loss (a tensor, or None where there is none) holds NaN or inf: one synchronisation."""
    return isinstance(value, torch.Tensor) and not bool(value.detach().isfinite().all())


@contextlib.contextmanager
def explained_model_failure(model: nn.Module, batch: Batch):
    """Around the model call on the training data's first batch: a failure (a forward(obs) given (obs, actions) by
    a batch (obs, actions, returns)) is raised as a ValueError that says how the batch was called, before any
    optimizer step."""
    try:
        yield
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise FirstCallError(model_failure(model, batch, error, "the training data")) from error


def model_failure(model: nn.Module, batch: Batch, error: Exception, source: str) -> str:
    """Why the model failed on `source`'s first batch: its error, how the batch was split and called, what to pass."""
    return (
        f"the model failed on {source}'s first batch ({describe(batch)}) before training started: "
        f"{_one_line(error)}. {how_called(batch)}{dtype_mismatch(model, batch)} If the model takes other arguments, "
        "yield batches (inputs, target) with inputs what it takes (a tensor → model(inputs), a tuple → "
        "model(*inputs), a dict → model(**inputs)); put what else the loss needs in the target, which your "
        "loss_fn of (outputs, target) gets whole: e.g. (obs, torch.stack([actions.float(), returns], 1)) for a "
        "policy forward(obs)."
    )


def how_called(batch: Batch) -> str:
    """How a batch was split into inputs and target, and the call the model got, in words."""
    if batch.moves_itself:
        return "The batch was passed whole, as model(batch), its .y the target."
    if batch.target_to_model:
        return "The batch was split into images and per-example targets and called as model(images, targets)."
    if batch.kwargs:
        keywords = ", ".join(f"{key}=…" for key in batch.kwargs)
        return f"The batch's dict entries were passed as keyword arguments: model({keywords})."
    count = len(batch.args)
    arguments = ", ".join(f"inputs[{index}]" for index in range(count)) if count > 1 else "inputs"
    split = f"{count} inputs and a target" if count > 1 else "inputs and a target"
    return f"The batch was split into {split} (its last element) and called as model({arguments})."


def _first_eval_batch(eval_data, device: torch.device, channels_last: bool) -> Batch:
    """The first batch evaluation would read, on the device (a Dataset's first EVAL_CHECK_EXAMPLES examples)."""
    size = EVAL_CHECK_EXAMPLES if isinstance(eval_data, Dataset) else None
    try:
        loader = as_loader(eval_data, size, device, shuffle=False, channels_last=channels_last, shard=False)
        raw = next(iter(loader), None)
        if raw is None:
            raise ValueError("it gives no batch (it is empty, or smaller than one batch with drop_last)")
        return batch_on_device(raw, device, channels_last)
    except TypeError as error:
        raise TypeError(f"eval_data: {error}") from error
    except ValueError as error:
        raise ValueError(f"eval_data: {error}") from error


def check_first_batch(model: nn.Module, batch: Batch, precision: Precision, device: torch.device) -> None:
    """Floating-point inputs of another dtype than the model's weights: one forward without gradients says
    whether the model takes them (some cast their inputs); where it does not, the error names both dtypes
    instead of a kernel's words. Nothing runs where the dtypes agree."""
    mismatch = dtype_mismatch(model, batch)
    if not mismatch:
        return
    try:
        with _random_state_kept(device), buffers_kept(model), torch.no_grad(), training_mode(model, False):
            with precision.autocast():
                batch.call(model)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:
        raise ValueError(
            f"the training data does not match the model.{mismatch} (Its forward failed with {_one_line(error)}.)"
        ) from error


def dtype_mismatch(model: nn.Module, batch: Batch) -> str:
    """A sentence naming both dtypes where the batch's floating-point inputs differ from the model's weights."""
    weights = next((parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()), None)
    targets = {id(t) for t in tree_leaves(batch.target)}  # a detection target's boxes are no inputs
    inputs = {t.dtype for t in tree_leaves((batch.args, batch.kwargs)) if _is_float_tensor(t) and id(t) not in targets}
    if weights is None or not inputs or inputs == {weights}:
        return ""
    data = sorted(str(dtype).removeprefix("torch.") for dtype in inputs)
    model_dtype = str(weights).removeprefix("torch.")
    advice = (
        " (or keep the model in float32 and train in 16 bits with precision='bf16-mixed')"
        if weights.itemsize < 4
        else ""
    )
    return (
        f" Its floating-point inputs are {', '.join(data)} but the model's weights are {model_dtype}: convert the "
        f"data (inputs.to(torch.{model_dtype})) or the model (model.to(torch.{data[0]})){advice}."
    )


def batch_problem(batch: Batch, ignore_index: int) -> str | None:
    """How `batch` makes a loss non-finite, as the end of a sentence about it ("is not finite: …", "has all its …
    targets ignored …") with what to do; None if it holds no NaN or inf and scores a target (one synchronisation)."""
    named = _named_float_tensors(batch)
    counts = torch.stack([torch.stack([t.isnan().sum(), t.isinf().sum()]) for _, t in named]).tolist() if named else []
    found = [
        f"{name} holds {nan} NaN and {inf} infinite values"
        for (name, _), (nan, inf) in zip(named, counts)
        if nan or inf
    ]
    if found:
        return (
            f"is not finite: {'; '.join(found)}. This is a problem in the data, not in the learning rate: remove "
            "or fix those examples (e.g. torch.nan_to_num, or drop rows where torch.isfinite(x).all() is False)."
        )
    target = batch.target
    if is_class_tensor(target) and target.numel() and bool((target == ignore_index).all()):
        return (
            f"has all its {target.numel()} targets ignored (equal to {ignore_index}): the loss of no scored target is "
            "0/0 = NaN. This is a problem in the data, not in the learning rate: leave out examples without a scored "
            "target (padding only, or too short to predict a next token), or give each batch at least one."
        )
    return None


def is_class_tensor(value) -> bool:
    """An integer tensor of class indices or token ids (not bool)."""
    return (
        isinstance(value, torch.Tensor)
        and not value.is_floating_point()
        and not value.is_complex()
        and value.dtype != torch.bool
    )


def _named_float_tensors(batch: Batch) -> list[tuple[str, torch.Tensor]]:
    """Floating-point tensors by name ("input 0", "input 0[2]" for a list's third image, "the target[1]['boxes']")."""
    named = [(f"input {index}", t) for index, t in enumerate(batch.args)]
    named += [(f"input {key!r}", t) for key, t in batch.kwargs.items() if t is not batch.target]
    named.append(("the target", batch.target))
    leaves = [(f"{name}{keystr(path)}", t) for name, value in named for path, t in tree_flatten_with_path(value)[0]]
    return [(name, t) for name, t in leaves if _is_float_tensor(t)]


def _is_float_tensor(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def describe(batch: Batch) -> str:
    """A batch's tensors as shapes and dtypes, e.g. "inputs (8, 5) float64, target (8,) int64"."""

    def shown(tensor) -> str:
        if not isinstance(tensor, torch.Tensor):
            return describe_value(tensor)  # a list of images, a list of target dicts
        return f"{tuple(tensor.shape)} {str(tensor.dtype).removeprefix('torch.')}"

    inputs = [shown(t) for t in batch.args] + [f"{key}={shown(t)}" for key, t in batch.kwargs.items()]
    target = f", target {shown(batch.target)}" if batch.target is not None and "labels" not in batch.kwargs else ""
    return f"input{'s' if len(inputs) > 1 else ''} {', '.join(inputs)}{target}"


def _random_state_kept(device: torch.device):
    """Every random generator a check may draw from (torch's on the CPU and on a CUDA device) left as it was."""
    return torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type="cuda")


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()).rstrip(".")
    return f"{type(error).__name__}: {text}" if text else type(error).__name__
