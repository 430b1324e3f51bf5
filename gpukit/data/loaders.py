"""Loaders that feed `fit`.

- `DeviceLoader`: the whole dataset on the device as uint8; normalisation, random crop and
  flip as batched tensor operations there; a device-side permutation for shuffling. No
  per-batch host work, which is what the fastest CIFAR-10 training scripts do.
- `dataloader()`: the standard `torch.utils.data.DataLoader` path (worker processes, pinned
  memory, prefetching, per-image augmentation on the CPU), for comparison.
- `collate_lists`: a DataLoader's collate_fn that keeps examples as lists, for detection batches.
- `worker_crash`, `worker_crashes_explained`: what to do when a DataLoader's worker process dies (torch says only
  "DataLoader worker (pid(s) N) exited unexpectedly").
"""

from __future__ import annotations

import contextlib
import copy
import faulthandler
import math
import re
import signal
import traceback
from collections.abc import Iterable, Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

from .. import env
from ..env import resolve_device
from ..validation import check_seed
from .images import ImageDataset
from .loader_timing import check_workers
from .tokens import TextLoader, TokenDataset


def collate_lists(examples: list[tuple]) -> tuple[list, ...]:
    """A DataLoader's collate_fn for detection: [(image, target), …] → ([image, …], [target, …]), one list per
    field, nothing stacked (images may differ in size and targets in their number of boxes). What torchvision's
    detection references write as `lambda batch: tuple(zip(*batch))`, with lists."""
    return tuple(list(field) for field in zip(*examples))


def random_crop_flip(images: torch.Tensor, padding: int, flip: bool, generator: torch.Generator | None) -> torch.Tensor:
    """Random crop with reflect padding and random horizontal flip, on a whole batch at once.

    images: (B, C, H, W) on any device; every image gets its own offsets and flip.
    """
    batch, _, height, width = images.shape
    device = images.device
    if padding > 0:
        padded = torch.nn.functional.pad(images, (padding,) * 4, mode="reflect")
        dy = torch.randint(0, 2 * padding + 1, (batch, 1), device=device, generator=generator)
        dx = torch.randint(0, 2 * padding + 1, (batch, 1), device=device, generator=generator)
        rows = (dy + torch.arange(height, device=device))[:, None, :, None]  # (B, 1, H, 1)
        cols = (dx + torch.arange(width, device=device))[:, None, None, :]  # (B, 1, 1, W)
        index = torch.arange(batch, device=device)[:, None, None, None]
        channel = torch.arange(images.shape[1], device=device)[None, :, None, None]
        images = padded[index, channel, rows, cols]
    if flip:
        flips = torch.rand(batch, device=device, generator=generator) < 0.5
        images = torch.where(flips[:, None, None, None], images.flip(-1), images)
    return images


class DeviceLoader:
    """Batches from a dataset that lives on the device as uint8, with on-device augmentation.

    Each epoch's order and augmentation come from a generator seeded with (seed, epoch), so
    an epoch can be replayed exactly (resuming) and every rank of a distributed job agrees
    on the permutation and takes its own shard (`rank`, `world_size`).
    """

    def __init__(
        self,
        dataset: ImageDataset,
        batch_size: int,
        *,
        shuffle: bool = True,
        augment: bool = False,
        padding: int = 2,
        drop_last: bool | None = None,
        device: str | torch.device | None = None,
        dtype: torch.dtype = torch.float32,
        channels_last: bool = False,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
    ):
        if not isinstance(dataset, ImageDataset):
            raise TypeError(
                f"DeviceLoader takes an ImageDataset (from gpukit.data.shapes() or cifar10()), got "
                f"{type(dataset).__name__}; use gpukit.data.dataloader() for other datasets."
            )
        if batch_size <= 0:
            raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
        if len(dataset) == 0:
            raise ValueError("the dataset is empty; give it at least one image.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1, got rank={rank}, world_size={world_size}.")
        self.device = resolve_device(device)
        self.dataset = dataset
        self.batch_size = batch_size
        self.shuffle = shuffle
        self.augment = augment
        self.padding = padding
        self.drop_last = shuffle if drop_last is None else drop_last
        self.dtype = dtype
        self.channels_last = channels_last
        self.seed = check_seed(seed)
        self.rank, self.world_size = rank, world_size
        self.epoch = 0
        self.images = dataset.images.to(self.device)  # uint8: 4× less memory than float32
        self.labels = dataset.labels.to(self.device)
        self.mean = (dataset.mean * 255).to(self.device, dtype)[None, :, None, None]
        self.std = (dataset.std * 255).to(self.device, dtype)[None, :, None, None]
        # The order comes from a CPU generator on every device (CUDA's gives other numbers for the same seed, and
        # a run must see the same batches on a GPU as on the CPU); augmentation draws on the device, per batch.
        self.order_generator = torch.Generator()
        self.generator = torch.Generator(self.device)
        self.shard_size = len(dataset) // world_size if world_size > 1 else len(dataset)

    @property
    def classes(self) -> tuple[str, ...]:
        return self.dataset.classes

    def for_rank(self, rank: int, world_size: int) -> DeviceLoader:
        """This loader for one rank of a distributed job: the same data on the device, its own shard.

        Every rank draws the same permutation per epoch and takes an interleaved, equal share.
        """
        if world_size == self.world_size and rank == self.rank:
            return self
        if self.world_size != 1:
            raise ValueError(f"the DeviceLoader is sharded for {self.world_size} ranks but the job has {world_size}.")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must lie in 0..world_size-1, got rank={rank}, world_size={world_size}.")
        sharded = copy.copy(self)  # shares the data already on the device; only the shard differs
        sharded.rank, sharded.world_size = rank, world_size
        sharded.shard_size = len(self.dataset) // world_size
        return sharded

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        if self.drop_last:
            return self.shard_size // self.batch_size
        return math.ceil(self.shard_size / self.batch_size)

    def _order(self) -> torch.Tensor:
        if self.shuffle:
            self.order_generator.manual_seed(self.seed * 1_000_003 + self.epoch)
            order = torch.randperm(len(self.labels), generator=self.order_generator).to(self.device)
        else:
            order = torch.arange(len(self.labels), device=self.device)
        # Every rank drew the same permutation; each takes an interleaved, equal-sized shard.
        return order[self.rank : self.shard_size * self.world_size : self.world_size]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        order = self._order()
        self.generator.manual_seed(self.seed * 1_000_003 + self.epoch)  # the epoch's augmentation, replayable
        memory_format = torch.channels_last if self.channels_last else torch.contiguous_format
        for start in range(0, len(self) * self.batch_size, self.batch_size):
            index = order[start : start + self.batch_size]
            images = self.images[index].to(self.dtype)
            if self.augment:
                images = random_crop_flip(images, self.padding, True, self.generator)
            images = ((images - self.mean) / self.std).contiguous(memory_format=memory_format)
            yield images, self.labels[index]
        self.epoch += 1

    def __repr__(self) -> str:
        return (
            f"DeviceLoader({len(self.dataset)} images on {self.device}, batch_size={self.batch_size}, "
            f"shuffle={self.shuffle}, augment={self.augment}, {len(self)} batches)"
        )


class _CropFlip:
    """Per-image random crop and flip for the DataLoader path (runs in worker processes)."""

    def __init__(self, padding: int):
        self.padding = padding

    def __call__(self, image: torch.Tensor) -> torch.Tensor:
        return random_crop_flip(image[None], self.padding, True, None)[0]


def dataloader(
    dataset: Dataset,
    batch_size: int,
    *,
    shuffle: bool = True,
    augment: bool = False,
    padding: int = 2,
    num_workers: int = 0,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = None,
    drop_last: bool | None = None,
    seed: int = 0,
) -> DataLoader:
    """The standard PyTorch input pipeline: worker processes, pinned memory and prefetching.

    Augmentation (for an ImageDataset) runs per image on the CPU, as with torchvision transforms.
    """
    if batch_size <= 0:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size}.")
    seed = check_seed(seed)
    if len(dataset) == 0:
        raise ValueError("the dataset is empty; give it at least one image.")
    check_workers(num_workers, prefetch_factor)
    if augment:
        if not isinstance(dataset, ImageDataset):
            raise TypeError("augment=True needs an ImageDataset; add a transform to your own dataset instead.")
        dataset = ImageDataset(
            dataset.images, dataset.labels, dataset.classes, dataset.mean, dataset.std, _CropFlip(padding)
        )
    if pin_memory is None:
        pin_memory = env.detect().device == "cuda"  # asks NVML: does not initialise CUDA here
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=num_workers,
        pin_memory=pin_memory,
        prefetch_factor=prefetch_factor,
        persistent_workers=num_workers > 0,
        drop_last=shuffle if drop_last is None else drop_last,
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=show_crashes if num_workers > 0 else None,
    )


def loader_for(
    dataset: Dataset,
    batch_size: int,
    device: str | torch.device | None = None,
    *,
    shuffle: bool,
    seed: int = 0,
    channels_last: bool = False,
    rank: int = 0,
    world_size: int = 1,
    pin_memory: bool | None = None,
    **options,
) -> Iterable:
    """The one place a Dataset becomes a loader (fit, evaluate and gk.distributed.sharded_loader call it).

    An ImageDataset gets the device-resident DeviceLoader, a TokenDataset the TextLoader (each with its
    rank's share), an IterableDataset a plain DataLoader, any other Dataset a DataLoader: shuffled from
    `seed`, with a DistributedSampler when world_size > 1, in page-locked memory for a CUDA device.
    `options` go to the DataLoader (num_workers, collate_fn, ...).

    Every sample is used: a last partial batch is kept (150 samples at batch_size 32: batches of 32, 32, 32, 32
    and 22), as a hand-written DataLoader loop does. Only a last batch of one sample per rank is left out when
    shuffling (training; evaluation keeps it): BatchNorm cannot train on one ("Expected more than 1 value per
    channel"). With several ranks, each gets an equal share (up to world_size - 1 samples left out, as before).
    """
    device, seed = resolve_device(device), check_seed(seed)
    shard = {"rank": rank, "world_size": world_size}
    pin = device.type == "cuda" if pin_memory is None else pin_memory  # the copy to the GPU can overlap compute
    if isinstance(dataset, IterableDataset):
        return DataLoader(dataset, batch_size=batch_size, pin_memory=pin, **options)
    # Training (shuffled) leaves out a last batch of one sample per rank (BatchNorm); evaluation keeps every sample.
    # Samples per rank: the device-resident loaders give each rank len // world_size.
    drop_last = shuffle and _only_one_left(len(dataset) // world_size, batch_size)
    if isinstance(dataset, ImageDataset):
        return DeviceLoader(
            dataset,
            batch_size,
            shuffle=shuffle,
            drop_last=drop_last,
            device=device,
            channels_last=channels_last,
            seed=seed,
            **shard,
        )
    if isinstance(dataset, TokenDataset):
        return TextLoader(dataset, batch_size, shuffle=shuffle, drop_last=drop_last, device=device, seed=seed, **shard)
    if world_size > 1:
        sampler = DistributedSampler(dataset, world_size, rank, shuffle=shuffle, seed=seed, drop_last=shuffle)
        drop_last = shuffle and _only_one_left(len(sampler), batch_size)
        return DataLoader(dataset, batch_size, sampler=sampler, drop_last=drop_last, pin_memory=pin, **options)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        drop_last=drop_last,
        pin_memory=pin,
        generator=torch.Generator().manual_seed(seed),
        **options,
    )


DYING_SECONDS = 1.0  # how long a DataLoader worker that broke its pipe gets to end, to read its exit code


def show_crashes(worker_id: int) -> None:
    """A DataLoader's worker_init_fn: a worker that crashes in C code (a segmentation fault in an image decoder or
    another extension) prints its Python stack, the line of your Dataset it was running, before it dies."""
    faulthandler.enable()


def worker_crash(error: BaseException) -> str | None:
    """What happened and what to do, when `error` is a DataLoader's report that a worker process died; None for any
    other error. Told by where torch raised it, not by its text: in the loader's wait for data (a RuntimeError
    listing the workers that failed, or the pipe's own error when the worker dies as it sends), or in its SIGCHLD
    handler (which names the worker and its signal only in its message: read from there)."""
    for frame, _ in traceback.walk_tb(error.__traceback__):
        module, name = frame.f_globals.get("__name__", ""), frame.f_code.co_name
        if module == "torch.utils.data.dataloader" and name == "_try_get_data":
            dead = frame.f_locals.get("failed_workers") or _dead_workers(frame.f_locals.get("self"))
            if dead:
                ended = "; ".join(_ended(worker) for worker in dead)
                break
        if module == "torch.utils.data._utils.signal_handling" and name == "handler":
            ended = _ended_as_torch_says(str(error)) or "a worker process ended"
            break
    else:
        return None
    return (
        f"A DataLoader worker process died ({ended}), so its batches never came: the Dataset's __getitem__ or the "
        "collate_fn crashed in C code it calls (a segmentation fault: an image decoder, a library that is not safe to "
        "use after fork), or the worker was killed (out of memory). Run with num_workers=0 to get the failure in this "
        "process, with its Python traceback; with gk.data.dataloader(), a crashing worker prints its Python stack "
        "above. With a checkpoint_dir, fit resumes from the last save."
    )


def _dead_workers(iterator) -> list:
    """The loader iterator's worker processes that have ended, each given a moment to finish dying (a worker that
    crashed as it sent a batch breaks the pipe before its exit code is known)."""
    dead = []
    for worker in getattr(iterator, "_workers", []):
        for _ in range(2):  # torch's SIGCHLD handler raises (in this wait) when the worker ends: that is the news
            with contextlib.suppress(RuntimeError):
                worker.join(timeout=DYING_SECONDS)
                break
        if worker.exitcode not in (None, 0):
            dead.append(worker)
    return dead


def _ended_as_torch_says(message: str) -> str | None:
    """torch's SIGCHLD handler names a killed worker only in its message ("DataLoader worker (pid 12) is killed by
    signal: Killed."): the pid and the signal, said as _ended says them; None where the message does not name them."""
    found = re.search(r"\(pid (\d+)\) is killed by signal: ([^.]+)\.", message)
    names = {signal.strsignal(each): each.name for each in signal.Signals if signal.strsignal(each)}
    if found is None or found.group(2).strip() not in names:
        return None
    return f"pid {found.group(1)} killed by {names[found.group(2).strip()]}"


def _ended(worker) -> str:
    code = worker.exitcode
    if code is not None and code < 0 and -code in signal.valid_signals():
        return f"pid {worker.pid} killed by {signal.Signals(-code).name}"
    return f"pid {worker.pid} exited with code {code}"


@contextlib.contextmanager
def worker_crashes_explained() -> Iterator[None]:
    """Around a loop over a DataLoader: a worker's death gets worker_crash's note."""
    try:
        yield
    except (RuntimeError, OSError) as error:
        note = worker_crash(error)
        if note is not None:
            error.add_note(note)
        raise


def _only_one_left(samples: int, batch_size: int) -> bool:
    """Whether the last batch of `samples` would hold a single sample (and is to be left out: drop_last)."""
    return samples % batch_size == 1
