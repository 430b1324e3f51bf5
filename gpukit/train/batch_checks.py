"""Mistakes found in the data while training, each named with the batch and what to do:

check_host_targets   on a GPU, each batch's integer class targets read on the host before their copy: one out of
                     range would end the process in a device-side assert;
failed_batch_cause   when a training step fails: the cause read from the batch's data (a target out of
                     range, a batch of one sample under BatchNorm, ids beyond the embedding table that looked
                     them up, inputs that carry an autograd graph an earlier backward freed), or None;
failed_read_cause    when reading the next batch fails: a batch on the meta device, or the items a DataLoader could
                     not put together (None, another shape), read again and named with their dataset index;
check_finite_inputs  after a non-finite loss: NaN or inf in the batch in hand, or no target of it scored
                     (all ignored), is a problem in the data;
earlier_problem      after a non-finite loss or weights whose last batch shows no cause: the epoch read again
                     (only then), and the earlier batch that holds NaN or inf or scores no target named;
warn_if_scalars_ignored  at the first step: scalar tensors the model returns beside its prediction (an
                     auxiliary loss) that the loss leaves out, said once per fit.
"""

from __future__ import annotations

import itertools
import operator
import warnings
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from .. import distributed
from ..data.loaders import worker_crashes_explained
from ..step import Batch, BatchError, Loss, describe_value, named_outputs, split_batch, unpack_outputs
from .checks import FirstCallError, NonFiniteInputError, batch_problem, describe, dtype_mismatch, is_class_tensor
from .data import batch_on_device, exact_device
from .saved_state import (
    global_generators,
    order_replayable,
    order_state,
    restore_global_generators,
    restore_order,
)
from .tally import callers_stacklevel


def check_finite_inputs(
    batch: Batch | None, step: int, epoch: int, ignore_index: int, earlier: Callable[[], str | None] | None = None
) -> None:
    """After a non-finite loss: NaN or inf in the floating-point tensors of the batch in hand, or class targets all
    equal to `ignore_index` (a loss of 0/0), is named as a problem in the data, with the step that read the batch
    (one synchronisation, once); where the batch in hand shows none, `earlier()` says what an earlier batch shows
    (earlier_problem), or None.

    In a distributed job every rank calls it at the same log step (the logged loss is summed over ranks) and one
    all_gather_object says whose batch it is: DDP's all-reduce of the gradients carries one rank's NaN to every rank,
    whose own batches are finite, and without it those ranks blamed the learning rate."""
    problem = data_problem(batch, step, epoch, ignore_index)
    if problem is None and earlier is not None:
        problem = earlier()
    ranks = distributed.world_size()
    if ranks == 1:
        if problem is not None:
            raise NonFiniteInputError(problem)
        return
    found = [(rank, said) for rank, said in enumerate(distributed.objects_over_ranks(problem)) if said is not None]
    if found:
        rank, said = found[0]
        others = (
            ", whose own batches are finite."
            if len(found) == 1
            else f" (ranks {[r for r, _ in found]} hold such data)."
        )
        raise NonFiniteInputError(
            f"on rank {rank} of {ranks}, {said} DDP's all-reduce of the gradients carried it to every rank{others}"
        )


def data_problem(batch: Batch | None, step: int, epoch: int, ignore_index: int) -> str | None:
    """What check_finite_inputs raises about `batch` (NaN or inf in it, or every target ignored), or None."""
    problem = None if batch is None else _problem(batch, ignore_index)
    if problem is None:
        return None
    return (
        f"the loss became non-finite by optimizer step {step} (epoch {epoch + 1}), and the batch that step read "
        f"last ({describe(batch)}) {problem}"
    )


def earlier_problem(run, epoch: int, in_hand: Batch | None, read: int | None = None, what: str = "loss") -> str | None:
    """After the `what` ("loss", "weights") of fit's `run` became non-finite in epoch `epoch` (from 0) and the batch
    in hand shows no cause: the epoch's batches read again from its start in its order, without the model, as many as
    training had read (`read`, else by the last optimizer step); the first that holds NaN or inf or scores no target,
    in words, or None. Such a batch makes the loss logged over a window of steps NaN, and NaN inputs reach the weights
    through its backward even where its loss leaves them out (an ignored target): the batch read last is finite.

    Named only where the order read again is training's: the batch in hand (`in_hand`, by its values) found where
    training read it, or, without one (a save), a loader whose order the saved state replays. Read only on this path,
    so that no step pays for it; the generators and the loader's state are put back. A failure to read is no answer
    (None): in a distributed job every rank must reach check_finite_inputs' gather."""
    loader = run.loader
    if run.epoch_start is None or isinstance(loader, Iterator) or in_hand is None and not order_replayable(loader):
        return None  # (an iterator is read once; an order from elsewhere would name another batch)
    read = read or run.batches_read()
    try:
        found = _read_again(run, in_hand, read)
    except Exception:  # the diagnosis only: the error it would explain is raised either way
        return None
    if found is None:
        return None
    number, batch, problem = found
    return (
        f"the {what} became non-finite by optimizer step {run.step_index} (epoch {epoch + 1}), and batch {number} of "
        f"the epoch ({describe(batch)}){', read before the last,' if in_hand is not None else ''} {problem}"
        + (
            " The loss logged is the mean over the steps since the last row: one such batch makes it non-finite, and"
            " NaN that a batch's backward carries into the weights makes every later loss NaN."
            if in_hand is not None
            else " Its backward carried the NaN into the weights."
        )
    )


def _read_again(run, in_hand: Batch | None, read: int) -> tuple[int, Batch, str] | None:
    """(number from 1, batch, problem) of the first of the epoch's first `read` batches with a problem, read again from
    run.epoch_start; None if none, or if the batch in hand is not among those training read last (another order)."""
    loader, device = run.loader, exact_device(run.device)
    last = read + (run.accumulate - 1 if in_hand is not None else 0)  # (an unfinished step's may follow, at an end)
    found, matched, now = None, in_hand is None, (global_generators(device), order_state(loader))
    try:
        restore_global_generators(run.epoch_start["generators"], device)
        restore_order(loader, run.epoch_start["order"])
        with worker_crashes_explained():
            for number, raw in enumerate(itertools.islice(loader, last), 1):
                batch = batch_on_device(raw, device, run.channels_last)
                problem = None if found else _problem(batch, run.loss.ignore_index)
                found = found or (problem and (number, batch, problem))
                if number >= read and in_hand is not None and _same_values(batch, in_hand):
                    matched = True
                    break
    finally:
        restore_global_generators(now[0], device)
        restore_order(loader, now[1])
    return found if matched else None


def _same_values(a: Batch, b: Batch) -> bool:
    first, second = a.tensors(), b.tensors()
    return len(first) == len(second) and all(
        x.shape == y.shape and x.dtype == y.dtype and x.device == y.device and torch.equal(x, y)
        for x, y in zip(first, second)
    )


def _problem(batch: Batch, ignore_index: int) -> str | None:
    """batch_problem's words, and where every example that holds NaN or inf scores no target, that its loss leaves
    them out but its backward does not (a NaN that 0 × NaN carries into the weights' gradients)."""
    problem = batch_problem(batch, ignore_index)
    target = batch.target
    if problem is None or not problem.startswith("is not finite") or not is_class_tensor(target) or not target.dim():
        return problem
    size = target.shape[0]
    inputs = [t for t in (*batch.args, *batch.kwargs.values()) if _is_float(t) and t.dim() and t.shape[0] == size]
    if not inputs:
        return problem
    bad = torch.stack([~t.isfinite().reshape(size, -1).all(1) for t in inputs]).any(0)  # (B,): examples with NaN/inf
    scored = ~(target == ignore_index).reshape(size, -1).all(1)  # (B,): examples with a target the loss scores
    if bool((bad & scored).any()) or not bool(bad.any()):  # (one synchronisation each, after the failure)
        return problem
    return (
        f"{problem} The NaN or inf is only in examples whose targets are all ignored: the loss leaves them out, but "
        "not their gradient, which carries it into the weights."
    )


def _is_float(value) -> bool:
    return isinstance(value, torch.Tensor) and (value.is_floating_point() or value.is_complex())


def check_host_targets(raw, number: int, *, loss: Loss, device: torch.device, epoch: int):
    """`raw` (a batch as the loader gave it) if its integer targets on the host are classes of the model's outputs;
    else a BatchError naming the batch, the value and the classes. For training on a GPU, where an out-of-range target
    is a device-side assert that ends the process: checked before the copy, with a min and a max on the host (no
    synchronisation; microseconds for a batch of labels or token ids). Known from the second batch on: the first
    batch's loss reads the number of classes."""
    classes = loss.classes
    target = split_batch(raw).target if classes is not None else None
    if not is_class_tensor(target) or target.device.type != "cpu" or target.numel() == 0:
        return raw
    low, high = (int(value) for value in torch.aminmax(target))
    if low == loss.ignore_index and high < classes:
        scored = target[target != loss.ignore_index]  # padding: the smallest scored target, where there is one
        low = int(scored.min()) if scored.numel() else 0
    if low >= 0 and high < classes:
        return raw
    wrong = high if high >= classes else low
    raise BatchError(
        f"batch {number} of epoch {epoch + 1} holds the class target {wrong}, out of range for the model's {classes} "
        f"outputs (0..{classes - 1}; {loss.ignore_index} is ignored): on {device} it would end the process in a "
        "device-side assert, so it was refused before its copy. Fix the labels (numbered from 1? subtract 1), or "
        f"give the model {max(high + 1, classes)} outputs."
    )


def failed_batch_cause(error: Exception, model: nn.Module, batch: Batch) -> str | None:
    """Why a training step failed on `batch`, where its data tells, in words (for fit to name the batch); None where
    the data shows no cause. Values are read only here, after the failure (one synchronisation)."""
    if isinstance(error, BatchError):  # the loss found it: a target out of range, every target ignored
        return str(error)
    if isinstance(error, FirstCallError):  # the first batch's model call, explained: its cause may be in the data
        return _ids_beyond_table(error.__cause__, model)
    if isinstance(error, ValueError) and batch.size == 1:
        norms = [name for name, module in model.named_modules() if _is_batch_norm(module) and module.training]
        if norms:
            return (
                f"it holds a single sample, and the BatchNorm layer {norms[0]!r} cannot compute batch statistics "
                "from one value per channel in training. Leave such batches out: pass drop_last=True to the "
                "DataLoader, or choose a batch_size that leaves no last batch of one."
            )
    if isinstance(error, RuntimeError) and "backward through the graph a second time" in str(error):
        return _inputs_with_a_graph(batch)
    if isinstance(error, RuntimeError) and (mismatch := dtype_mismatch(model, batch)):  # the first batch's agreed
        return f"its inputs changed dtype after the first batch, which fit checked.{mismatch}"
    if isinstance(error, (IndexError, RuntimeError)):
        return _ids_beyond_table(error, model)
    return None


def _inputs_with_a_graph(batch: Batch) -> str | None:
    """Batch tensors computed from tensors that require grad (a grad_fn), where a backward failed for a graph freed
    before: batches cut from one tensor computed once (x = base * w) share its graph, which the first batch's backward
    freed. torch's advice, retain_graph=True, would backpropagate into the data at every step."""
    carrying = [t for t in batch.tensors() if t.grad_fn is not None]
    if not carrying:
        return None  # (a graph the model keeps across steps: a recurrent state not detached)
    return (
        f"its data carries an autograd graph ({len(carrying)} of its tensors have a grad_fn, e.g. "
        f"{tuple(carrying[0].shape)} from {type(carrying[0].grad_fn).__name__}: computed from tensors that require "
        "grad), which it shares with an earlier batch whose backward freed it. Do not pass retain_graph=True, which "
        "would backpropagate into the data at every step: detach the inputs (x.detach()), or build them under "
        "torch.no_grad()."
    )


def failed_read_cause(error: Exception) -> str | None:
    """Why reading the next batch failed, where its data tells (fit and evaluate put the batch's number in front);
    None for a failure elsewhere (training on a batch: failed_batch_cause) or where the data shows no cause.

    A batch on the meta device is move_batch's BatchError. A DataLoader (without workers) whose collate_fn failed
    leaves the batch's dataset indices in its iterator's frame (`_next_data`'s `index`, in the error's traceback):
    those items are read again (dataset[i], only now: no step pays for it) and those of another form than the
    others' (None, another shape) named. Items that all look alike, or indices that cannot be known (workers), add
    nothing."""
    called = error.__traceback__.tb_next if error.__traceback__ is not None else None
    if isinstance(error, BatchError) and called is not None and called.tb_frame.f_code.co_name == "batch_on_device":
        return str(error)
    reading = _loader_frame(error)
    if reading is None:
        return None
    indices, dataset = reading
    try:
        items = [dataset[index] for index in indices]
    except Exception:  # the diagnosis only: the error it would explain is raised either way
        return None
    forms = [_form(item) for item in items]
    usual, count = Counter(forms).most_common(1)[0]  # (a tie: the form seen first)
    odd = [(index, form) for index, form in zip(indices, forms) if form != usual]
    if not odd or 2 * count <= len(forms):  # no form most items share: none to call the odd one
        return None
    named = "; ".join(f"dataset[{index}] returned {form}" for index, form in odd[:3])
    return (
        f"the DataLoader could not put its {len(items)} items together ({type(error).__name__} in its collate_fn): "
        f"{named}{' (and more)' * (len(odd) > 3)}, where its other {count} items are {usual}. Fix the dataset's "
        "__getitem__ so that every item has one form, or give the DataLoader a collate_fn that pads items to one "
        "shape (or leaves out None)."
    )


def _loader_frame(error: Exception) -> tuple[list[int], object] | None:
    """(the batch's dataset indices, the dataset) from the frame of a single-process DataLoader iterator's
    `_next_data` in `error`'s traceback, or None."""
    traceback = error.__traceback__
    while traceback is not None:
        frame = traceback.tb_frame
        found, iterator = frame.f_locals, frame.f_locals.get("self")
        if frame.f_code.co_name == "_next_data" and type(iterator).__name__ == "_SingleProcessDataLoaderIter":
            indices, dataset = found.get("index"), getattr(iterator, "_dataset", None)
            try:
                return [operator.index(i) for i in indices], dataset
            except TypeError:  # no batch of indices (an IterableDataset's, or batch_size=None)
                return None
        traceback = traceback.tb_next
    return None


def _form(item) -> str:
    """An item's form, what default_collate needs alike in every item: None, shapes, keys, lengths ("(a tensor of
    shape (4,), a number)"); numbers alike, dtypes not said (collate promotes them)."""
    if item is None:
        return "None"
    if isinstance(item, torch.Tensor) or hasattr(item, "shape") and hasattr(item, "dtype"):
        return f"a tensor of shape {tuple(item.shape)}" if item.shape else "a number"
    if isinstance(item, (int, float, complex)):
        return "a number"
    if isinstance(item, (tuple, list)):
        return f"({', '.join(_form(part) for part in item)})"
    if isinstance(item, Mapping):
        return "{" + ", ".join(f"{key!r}: {_form(value)}" for key, value in item.items()) + "}"
    return f"a {type(item).__name__}"


def _is_batch_norm(module: nn.Module) -> bool:
    return isinstance(module, nn.modules.batchnorm._BatchNorm)  # BatchNorm1d, 2d, 3d, SyncBatchNorm and lazy ones


_TABLES = (nn.Embedding, nn.EmbeddingBag)


def _ids_beyond_table(error: BaseException | None, model: nn.Module) -> str | None:
    """The ids of the embedding lookup that raised `error`, against that table's rows, in words; None where no lookup
    failed (a length of 0 given to pack_padded_sequence is no token id) or its ids lie in range. The table and its ids
    are read from the failed call itself, F.embedding(input, weight) in the error's traceback: an id beyond one table
    is named even where another, larger table would hold it."""
    tables = {id(module.weight): name for name, module in model.named_modules() if isinstance(module, _TABLES)}
    lookup, traceback = None, error.__traceback__ if error is not None else None
    while traceback is not None:  # to the innermost lookup
        found = traceback.tb_frame.f_locals
        if traceback.tb_frame.f_code.co_name in ("embedding", "embedding_bag") and id(found.get("weight")) in tables:
            lookup = found
        traceback = traceback.tb_next
    ids = lookup.get("input") if lookup is not None else None
    if not is_class_tensor(ids) or not ids.numel():
        return None
    name, rows = tables[id(lookup["weight"])], lookup["weight"].shape[0]
    try:
        low, high = torch.stack([ids.min(), ids.max()]).tolist()
    except RuntimeError:  # a device that failed for good
        return None
    if low >= 0 and high < rows:
        return None
    return (
        f"the ids it looks up in the embedding {name!r} (token ids) lie in {low}..{high}, but {name!r} has {rows} "
        f"rows (ids 0..{rows - 1}): an id is out of range for that table. Encode the data with the model's tokenizer "
        f"(or that table's numbering), or build the table with {high + 1} rows or more (vocab_size={high + 1})."
    )


def warn_if_scalars_ignored(loss: Loss, outputs) -> None:
    """Scalar tensors the model returns beside its prediction that the loss leaves out (a mixture of experts'
    load-balancing loss in (logits, aux_loss)): said once, at fit's first step, with the loss_fn that adds them."""
    ignored = loss.ignored_scalars(outputs)
    if not ignored:
        return
    prediction = unpack_outputs(outputs)[0]
    predicted = next(f"outputs{path}" for path, value in named_outputs(outputs) if value is prediction)
    function = {"cross_entropy": "F.cross_entropy", "mse": "F.mse_loss"}.get(loss.name, loss.name)
    scalars = [f"outputs{key}" for key in ignored]
    what = f"{scalars[0]} is a scalar tensor" if len(scalars) == 1 else f"{', '.join(scalars)} are scalar tensors"
    warnings.warn(
        f"the model returns {describe_value(outputs)}: {what} (an auxiliary loss?) that the loss leaves out: it is "
        f"{loss.name} of the prediction {predicted} alone. To train on {' + '.join(scalars)} too, pass "
        f"loss_fn=lambda outputs, target: {function}({predicted}, target) + {' + '.join(scalars)} (your loss_fn gets "
        "the outputs whole); if they are no losses, ignore this warning.",
        stacklevel=callers_stacklevel(),  # the line that called fit, however deep in fit this is
    )
