"""`evaluate()`: loss, accuracy (where it means something) and your metrics on held-out data."""

from __future__ import annotations

import itertools
import math
import warnings
from collections.abc import Callable, Iterator

import torch
from torch import nn

from .. import distributed
from ..data.loaders import worker_crashes_explained
from ..env import resolve_device
from ..precision import Precision, get_precision
from ..step import Batch, BatchError, Loss, split_batch, training_mode
from .batch_checks import failed_read_cause
from .checks import NonFiniteInputError, batch_problem, describe, is_class_tensor
from .data import as_loader, move_batch
from .tally import Tally, callers_stacklevel, check_metrics, check_shifted_labels, predictions_can_wait


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data,
    *,
    batch_size: int | None = 512,
    precision: str | Precision = "fp32",
    device: str | torch.device | None = None,
    channels_last: bool = False,
    loss_fn: str | Callable | Loss | None = None,
    metrics: dict[str, Callable] | None = None,
    over_ranks: bool = False,
    shifted_labels: bool | None = None,
) -> dict:
    """Mean loss, accuracy (where it means something, see gpukit.step.losses) and `metrics` of `model` on `data`, in
    eval mode (no gradients).

    Returns {"loss", "accuracy" (where it applies), one entry per metric, "samples", and for sequence data
    "tokens" and "shifted_labels"}. The loss and metrics are means over samples; accuracy is over scored targets.
    A model that returns a dict of losses gets one entry per loss too ("loss_classifier", …).
    A batch whose integer targets all equal the loss's ignore_index (-100: padding only) scores nothing: it is
    left out (no loss, no token, no sample), where its mean loss would be 0/0 = NaN; if every batch is, it is an error.

    data: a Dataset, a loader or a re-iterable of batches of any form fit takes (gpukit.step).
    batch_size: the batch size of the loader built for a Dataset (512 by default); ignored for a loader or any other
        iterable, which brings its own batches.
    precision: "fp32", "tf32", "bf16-mixed", "fp16-mixed" or a Precision: evaluated under its autocast, as fit trains.
    device: where to evaluate (default: where the model's parameters or buffers are; a model with neither runs on the
        best device here). Batches are moved there.
    channels_last: 4-D floating-point batches in the channels_last memory layout, as fit's
        gk.ModelTransforms(channels_last=True) trains them (the model's weights are left as they are).
    loss_fn: your function of (outputs, target), "cross_entropy", "mse", a PyTorch loss or a gk.step.Loss (default:
        the model's own loss, else cross-entropy for integer targets), as in fit; a gk.CrossEntropy scores without
        its label smoothing, as fit's eval_loss.
    metrics: {name: fn(outputs, target) -> a number, or a dict of numbers (an entry "<name>_<key>" each)} per batch,
        averaged over samples.
    over_ranks: in a distributed job, every rank takes every world_size-th batch and the sums are
        added over the ranks (one all-reduce), so every rank returns the same figures, those of the
        whole data; every rank must call it (fit does, after each epoch). A model sharded with FSDP2
        gathers its parameters in every forward, a collective all ranks must join: every rank then
        evaluates every batch. Without it, each rank evaluates all of `data` on its own.
    shifted_labels: for token sequences, whether the tokens counted are labels[:, 1:]: those the loss scores where it
        scores the labels shifted by one, as a causal LM's own loss does (Hugging Face's model(input_ids,
        labels=labels) shifts inside: T - 1 tokens a sequence, 156 where the labels hold 176). None measures which at
        the first batch: the model's own loss (or your loss_fn) is compared with cross-entropy of its logits against
        the labels as given and shifted; where it cannot tell (neither or both match) it counts them as given and
        warns. The built-in losses score the target as given. The result's "shifted_labels" says which was counted.

    Detection (batches (images, targets), targets a list of dicts): the model is called as
    model(images, targets) in eval mode, as in training. torchvision's detectors then return their
    detections (a list of dicts of "boxes", "labels", "scores"), not losses: they compute losses only in
    training mode, where they also sample proposals at random and (with BatchNorm) update statistics, so
    evaluate does not switch to it: there is no "loss" entry, and `metrics` must be given, each a function
    of (detections, targets) returning a number or a dict of numbers (an entry "<name>_<key>" each) per
    batch, averaged over images. A statistic over the whole set that is no mean of batches (torchmetrics'
    MeanAveragePrecision) takes one batch holding every image, or your own loop over model(images).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"expected a torch.nn.Module to evaluate, got {type(model).__name__}.")
    device = resolve_device(device) if device is not None else _model_device(model)
    precision = get_precision(precision, device)
    loss = loss_fn if isinstance(loss_fn, Loss) else Loss(loss_fn, evaluation=True)  # CrossEntropy: no smoothing
    metrics = check_metrics(metrics)
    check_shifted_labels(shifted_labels)
    if isinstance(data, torch.utils.data.Dataset) is False:
        batch_size = None  # a loader or an iterable brings its own batches
    loader = as_loader(data, batch_size, device, shuffle=False, channels_last=channels_last, shard=False)
    split = over_ranks and distributed.world_size() > 1 and not distributed.is_sharded(model)
    if split:  # this rank's share of the batches: every world_size-th, none left out, none counted twice
        loader = itertools.islice(loader, distributed.rank(), None, distributed.world_size())
    tally, unscored = Tally(device, loss, metrics, predictions_can_wait(model, device), shifted_labels), 0
    with training_mode(model, False), worker_crashes_explained():  # a DataLoader worker that died: what to do
        number = 0
        try:
            for number, raw in enumerate(loader, 1):
                batch = split_batch(raw)
                if _scores_nothing(batch, loss.ignore_index):  # read before the copy where the target is on the host
                    unscored += 1
                    continue  # its mean loss would be 0/0 = NaN: no loss, token, sample or metric of it is added
                try:
                    batch = move_batch(batch, device, channels_last)  # split once, above
                    with precision.autocast():
                        outputs = batch.call(model)
                        value, parts = loss.of_evaluation(outputs, batch.target)  # None for a detector's detections
                except BatchError as error:  # a target out of range, a meta batch: say which batch
                    raise BatchError(f"batch {number} of the evaluation data: {error}") from error
                tally.add(batch, value, outputs, parts)
        except Exception as error:  # reading batch number + 1 failed: what its items show
            cause = failed_read_cause(error)
            if cause is None:
                raise
            raise BatchError(f"batch {number + 1} of the evaluation data: {cause}") from error
    if split:
        tally.over_ranks()
    if tally.samples == 0 and unscored:
        raise ValueError(
            f"evaluate() scores nothing: every one of its {unscored} batches has all its targets equal to "
            f"{loss.ignore_index} (ignored), so there is no loss to average (0/0 = NaN). Give the evaluation data "
            "targets to score (padding only, or sequences too short to predict a next token, have none)."
        )
    if tally.samples == 0:
        raise ValueError("evaluate() got no batches; the dataset is empty or smaller than one batch with drop_last.")
    counted = {"shifted_labels": bool(tally.shifted_labels)} if tally.sequences else {}
    result = tally.read(tokens=True) | {"samples": tally.samples} | counted
    if not math.isfinite(result.get("loss", 0.0)):  # the data read again, only now: which batch holds NaN or inf
        _explain_non_finite(result["loss"], data, batch_size, device, channels_last, loss.ignore_index, split)
    return result


def _explain_non_finite(value: float, data, batch_size, device, channels_last: bool, ignore_index: int, split: bool):
    """After a non-finite evaluation loss: the first batch of `data` (this rank's share with `split`) that holds NaN or
    inf raised as a NonFiniteInputError, named on every rank; where none does (or the data can be read only once), a
    warning that the model's outputs were not finite."""
    problem = None
    if not isinstance(data, Iterator):
        loader = as_loader(data, batch_size, device, shuffle=False, channels_last=channels_last, shard=False)
        ranks, rank = (distributed.world_size(), distributed.rank()) if split else (1, 0)
        with worker_crashes_explained():
            for index, raw in enumerate(itertools.islice(loader, rank, None, ranks)):
                batch = split_batch(raw)
                found = None if _scores_nothing(batch, ignore_index) else batch_problem(batch, ignore_index)
                if found is not None:
                    problem = f"batch {rank + index * ranks + 1} of the evaluation data ({describe(batch)}) {found}"
                    break
    said = [found for found in distributed.objects_over_ranks(problem) if found] if split else [problem] * bool(problem)
    if said:
        raise NonFiniteInputError(
            f"the evaluation loss is {value}, and its accuracy would count NaN outputs: {said[0]}"
        )
    warnings.warn(
        f"the evaluation loss is {value}, though no batch of the evaluation data holds NaN or inf"
        f"{'' if not isinstance(data, Iterator) else ' (it can be read only once: not looked at)'}: the model's "
        "outputs in eval mode are not finite (weights that hold NaN or inf, BatchNorm's running statistics, or an "
        "overflow in float16), and its accuracy counts them.",
        stacklevel=callers_stacklevel(),
    )


def _scores_nothing(batch: Batch, ignore_index: int) -> bool:
    """Whether the batch holds no sample, or integer targets all equal to `ignore_index` (-100: padding). Read on
    the host for a host tensor; a target already on a GPU costs one synchronisation per batch. A target on the meta
    device has no values to read: move_batch refuses it, with its batch's number."""
    if batch.size == 0:
        return True
    target = batch.target
    if not is_class_tensor(target) or target.is_meta or not target.numel():
        return False
    return bool((target == ignore_index).all())


def _model_device(model: nn.Module) -> torch.device:
    """Where the model's parameters (else its buffers) are; a model with neither runs anywhere: the best device."""
    tensor = next(itertools.chain(model.parameters(), model.buffers()), None)
    return tensor.device if tensor is not None else resolve_device(None)
