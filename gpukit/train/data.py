"""What fit and evaluate read: the data as a loader, and each batch split and on the device."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch.utils.data import DataLoader, Dataset

from .. import distributed
from ..data import DeviceLoader, ShardLoader, TextLoader
from ..data.loaders import loader_for
from ..data.prefetching import prefetch
from ..step import Batch, BatchError, split_batch, to_device
from ..validation import check_int

DEVICE_LOADERS = (DeviceLoader, TextLoader)  # loaders that keep the whole dataset on the device


def as_loader(
    data,
    batch_size: int | None,
    device: torch.device,
    *,
    shuffle: bool,
    channels_last: bool = False,
    seed: int = 0,
    shard: bool = True,
) -> Iterable:
    """What fit and evaluate iterate over: a loader as given, or one built for a Dataset.

    An ImageDataset gets the device-resident DeviceLoader, a TokenDataset the TextLoader, any
    other Dataset a DataLoader (with a DistributedSampler in a distributed job when `shard`).
    A DataLoader, a device-resident loader or any re-iterable of batches is used as it is.
    """
    if isinstance(data, (*DEVICE_LOADERS, DataLoader)):
        if batch_size is not None and batch_size != data.batch_size:
            raise ValueError(
                f"batch_size={batch_size} differs from the loader's batch_size={data.batch_size}; leave batch_size=None "
                "when passing a loader, or build the loader with the size you want."
            )
        if isinstance(data, DEVICE_LOADERS) and data.device != device:
            raise ValueError(
                f"the {type(data).__name__} keeps its data on {data.device} but training runs on {device}; make them agree."
            )
        return data
    if isinstance(data, Dataset):
        if batch_size is None:
            raise ValueError("batch_size is required when passing a Dataset (or pass a loader that has one).")
        check_int("batch_size", batch_size)
        if hasattr(data, "__len__") and len(data) == 0:
            raise ValueError("the dataset is empty; give it at least one example.")
        ranks = {"rank": distributed.rank(), "world_size": distributed.world_size()} if shard else {}
        return loader_for(data, batch_size, device, shuffle=shuffle, seed=seed, channels_last=channels_last, **ranks)
    if isinstance(data, (torch.Tensor, str, bytes, Mapping)) or not isinstance(data, Iterable):
        raise TypeError(
            f"expected a Dataset, a DataLoader, a DeviceLoader or TextLoader, or a re-iterable of batches (a list, "
            f"or an object with __iter__), got {type(data).__name__}."
        )
    if batch_size is not None:
        raise ValueError(
            f"batch_size applies to a Dataset; this {type(data).__name__} already yields batches, so leave batch_size=None."
        )
    return data


def length(loader) -> int | None:
    """Batches per epoch, or None for data without len()."""
    try:
        return len(loader)
    except TypeError:
        return None


def batches(
    loader, device: torch.device, iterator: Iterator | None = None, check: Callable | None = None, start: int = 0
) -> Iterable:
    """What the training loop iterates over: a host-side loader (DataLoader, ShardLoader) on a CUDA device
    copies each next batch on a side stream while the current step runs (gk.data.prefetch); any other
    loader as it is (device-resident ones need no copy). `iterator`: an epoch of `loader` already begun.
    `check(raw, number)`: called on each batch as the loader gave it, before any copy, numbered from `start` + 1."""
    source = loader if iterator is None else iterator
    if check is not None:
        source = (check(raw, number) for number, raw in enumerate(source, start + 1))
    return prefetch(source, device) if isinstance(loader, (DataLoader, ShardLoader)) else source


def batch_on_device(raw, device: torch.device, channels_last: bool) -> Batch:
    """A batch as it comes from the loader → split into inputs and target, on `device`. The common batch, a pair
    (inputs, target) of tensors already on `device` (`exact_device`'s: "cuda:0", not "cuda"), is taken in one test
    of its types and devices, without split_batch's look at every accepted form: a fifth of fit's own Python per
    step on a tiny model. Anything else (another form, a copy to make, channels_last) goes the whole way."""
    if type(raw) in _PAIRS and len(raw) == 2 and not channels_last:
        inputs, target = raw
        if type(inputs) is type(target) is torch.Tensor and inputs.device == device == target.device and target.dim():
            return Batch((inputs,), {}, target, target.shape[0])
    return move_batch(split_batch(raw), device, channels_last)


_PAIRS = (tuple, list)


def exact_device(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current CUDA device, what .to("cuda") picks, and a tensor's device
    always has its index (cuda:0 != cuda)."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def move_batch(batch: Batch, device: torch.device, channels_last: bool) -> Batch:
    """A batch already split (split_batch) on `device`, its 4-D floating-point tensors channels_last if asked."""
    if not _on_device(batch, exact_device(device)):
        try:
            batch = to_device(batch, device)
        except Exception as error:  # (the failure path only: no step pays for the look at its tensors)
            _refuse_meta(batch, error)
            raise
    if channels_last:
        batch = batch.map(
            lambda t: t.contiguous(memory_format=torch.channels_last) if t.dim() == 4 and t.is_floating_point() else t
        )
    return batch


def _refuse_meta(batch: Batch, error: Exception) -> None:
    """A batch with tensors on the meta device (shapes without values: "Cannot copy out of meta tensor") said as
    such, with what to pass instead; fit and evaluate put its number in front."""
    meta = [tensor for tensor in batch.tensors() if tensor.is_meta]
    if meta:
        raise BatchError(
            f"it holds {len(meta)} tensor(s) on the meta device (shapes without values, e.g. {tuple(meta[0].shape)} "
            f"{str(meta[0].dtype).removeprefix('torch.')}), which cannot be trained on or evaluated. Give real tensors "
            "(torch.zeros_like(tensor, device='cpu') keeps the shape); to predict memory from shapes alone, pass the "
            "meta batch to gk.memory.estimate instead."
        ) from error


def _on_device(batch: Batch, device: torch.device) -> bool:
    """Whether every tensor of a plain batch (tensors as inputs and target) is on `device` (an exact one) already:
    then `to_device` is skipped. Nested forms go through it."""
    tensors = (*batch.args, *batch.kwargs.values(), batch.target)
    return all(isinstance(tensor, torch.Tensor) and tensor.device == device for tensor in tensors)
