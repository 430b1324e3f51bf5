"""Packed shards: encoded images in WebDataset tar files, streamed through DataLoader workers.

Why tar shards (WebDataset): thousands of small files cost one open and one random read each, which
dominates when the files are not cached; a shard of a few MB is one open and one sequential read
for hundreds of samples. WebDataset's format is plain tar (`tar tf shard-000000.tar` lists it;
`{key}.jpg` + `{key}.cls` per sample), the library is small (numpy, braceexpand, pyyaml), and it
streams from local disks or URLs alike. LitData and MosaicML Streaming do the same job with their own
formats, and add cloud-storage clients: `pip install --dry-run` listed 9 extra packages for litdata
0.2.76 (boto3, obstore, ...) and 54 for mosaicml-streaming 0.13 (azure, google-cloud, transformers,
...), measured when this was written.

`ShardLoader(root, batch_size)` reads the shards of `write_shards`: each epoch it shuffles the order
of the shards, gives each DataLoader worker its own shards, and shuffles samples through a buffer,
all from generators seeded with (seed, epoch, worker): the same seed and num_workers replay the
same batches. A truncated or corrupt shard raises `ShardError` naming the shard and the sample.
"""

from __future__ import annotations

import json
import math
import os
import random
import tarfile
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from .. import env
from ..files import write_atomic
from ..validation import check_int, check_seed
from .formats import INDEX, _check_dataset, _fresh_folder, _metadata, _publish, decode, encode, read_index
from .images import ImageDataset
from .loader_timing import check_workers


def _webdataset():
    """The webdataset package, an optional dependency: `pip install "gpukit[data]"`."""
    try:
        import webdataset
    except ModuleNotFoundError:
        raise ModuleNotFoundError(
            "tar shards need the webdataset package: pip install 'gpukit[data]' (or pip install webdataset)."
        ) from None
    return webdataset


class ShardError(ValueError):
    """A shard is missing, empty, truncated or holds a sample that cannot be read."""


def write_shards(
    dataset: ImageDataset,
    root: str | os.PathLike,
    *,
    samples_per_shard: int = 1000,
    format: str = "jpeg",
    quality: int = 90,
) -> Path:
    """The dataset as WebDataset tar shards root/shard-000000.tar, … with `samples_per_shard` samples each.

    Each sample is `{index}.jpg` (or `.png`) and `{index}.cls` (the label as text). root/.index.json
    lists the shards with their sample counts and the dataset's classes, mean and std; it is written
    last, into a temporary folder that replaces `root` when complete.
    """
    _check_dataset(dataset)
    check_int("samples_per_shard", samples_per_shard)
    extension = {"jpeg": "jpg", "png": "png"}.get(format)
    if extension is None:
        raise ValueError(f"format={format!r} is unknown; use 'jpeg' or 'png'.")
    root = Path(root)
    temporary = _fresh_folder(root)
    shards = []
    labels = dataset.labels.tolist()
    for number, start in enumerate(range(0, len(dataset), samples_per_shard)):
        name = f"shard-{number:06d}.tar"
        stop = min(start + samples_per_shard, len(dataset))
        with open(temporary / name, "wb") as file:
            with _webdataset().TarWriter(file, mtime=0) as writer:  # an integer mtime: no PAX header per member
                for index in range(start, stop):
                    writer.write(
                        {
                            "__key__": f"{index:07d}",
                            extension: encode(dataset.images[index], format, quality),
                            "cls": str(labels[index]),
                        }
                    )
            file.flush()
            os.fsync(file.fileno())
        with tarfile.open(temporary / name) as tar:  # where each member's bytes start: read without parsing headers
            members = [[member.name, member.offset_data, member.size] for member in tar]
        shards.append(
            {"name": name, "samples": stop - start, "bytes": (temporary / name).stat().st_size, "members": members}
        )
    index = _metadata(dataset, "shards", format=format, shards=shards)
    write_atomic(temporary / INDEX, json.dumps(index).encode())
    return _publish(temporary, root)


def _seed(*parts: int) -> int:
    value = 0
    for part in parts:
        value = (value * 1_000_003 + part) % (2**63)
    return value


def read_shard(
    path: Path, expected: int | None = None, members: list | None = None, size: int | None = None
) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {extension: bytes}) for each sample of one tar shard, in order.

    With `members` ([name, data offset, size] per tar member, recorded by write_shards) the shard is read
    in one sequential read and sliced: Python's tarfile spends ~0.1 ms parsing each member's header,
    more than reading a small image. Without, WebDataset's tar iterator parses the stream.
    Raises ShardError naming the shard and the last good sample when the shard is empty, truncated or
    corrupt, or ends with fewer samples than the index lists.
    """
    if members is not None:
        yield from _read_indexed(path, members, size)
        return
    key, parts, count = None, {}, 0

    def where() -> str:
        return f"after sample {key!r} (sample {count} of the shard)" if key else "before its first sample"

    try:
        if path.stat().st_size == 0:
            raise ShardError(f"shard {path} is empty (0 bytes); write the shards again with gk.data.write_shards.")
        with open(path, "rb") as file:
            for member in _webdataset().tariterators.tar_file_iterator(file):
                stem, _, extension = member["fname"].partition(".")
                if stem != key:
                    if key is not None:
                        count += 1
                        yield key, parts
                    key, parts = stem, {}
                parts[extension.lower()] = member["data"]
    except (tarfile.TarError, EOFError, OSError) as error:
        raise ShardError(
            f"shard {path} is truncated or corrupt {where()}: {error}. Write the shards again with "
            "gk.data.write_shards, or delete this shard and its entry in .index.json."
        ) from None
    if key is not None:
        count += 1
        yield key, parts
    if expected is not None and count < expected:
        raise ShardError(
            f"shard {path} ended {where()} but .index.json lists {expected} samples: the shard is truncated. Write the "
            "shards again with gk.data.write_shards."
        )


def _read_indexed(path: Path, members: list, size: int | None) -> Iterator[tuple[str, dict[str, bytes]]]:
    with open(path, "rb") as file:
        data = file.read()  # one sequential read of the whole shard (a few MB); a slice copies only its own bytes
    if len(data) == 0:
        raise ShardError(f"shard {path} is empty (0 bytes); write the shards again with gk.data.write_shards.")
    key, parts, count = None, {}, 0
    for name, offset, length in members:
        stem, _, extension = name.partition(".")
        if stem != key:
            if key is not None:
                count += 1
                yield key, parts
            key, parts = stem, {}
        if offset + length > len(data) or offset < 512 or not data.startswith(name.encode(), offset - 512):
            problem = (
                "truncated" if offset + length > len(data) else "corrupt (a tar header is not where the index says)"
            )
            last = f"after sample {key!r} (sample {count} of the shard)" if count else "before its first sample"
            raise ShardError(
                f"shard {path} is {problem}: sample {stem!r} is incomplete, {last}; it has {len(data):,} bytes"
                f"{f' of {size:,}' if size else ''}. Write the shards again with gk.data.write_shards."
            )
        parts[extension.lower()] = data[offset : offset + length]
    if key is not None:
        yield key, parts


def _image_entry(path: Path, key: str, parts: dict[str, bytes]) -> tuple[str, bytes]:
    for extension in ("jpg", "jpeg", "png"):
        if extension in parts:
            return extension, parts[extension]
    raise ShardError(
        f"sample {key!r} in shard {path} has no image this loader can decode (found {sorted(parts)}; it reads "
        ".jpg, .jpeg and .png): write the shards with gk.data.write_shards, or convert those images."
    )


class ShardDataset(IterableDataset):
    """One epoch of samples from tar shards, split over DataLoader workers and shuffled through a buffer."""

    def __init__(
        self,
        root: Path,
        shards: list[dict],
        *,
        shuffle: bool,
        shuffle_buffer: int,
        seed: int,
        epoch: int,
        mean: torch.Tensor | None,
        std: torch.Tensor | None,
        raw: bool = False,
    ):
        self.root, self.shards = root, shards
        self.shuffle, self.shuffle_buffer = shuffle, shuffle_buffer
        self.seed, self.epoch = seed, epoch
        self.mean, self.std, self.raw = mean, std, raw

    def worker_shards(self, worker: int, workers: int) -> list[dict]:
        shards = list(self.shards)
        if self.shuffle:
            random.Random(_seed(self.seed, self.epoch)).shuffle(shards)
        return shards[worker::workers]

    def _samples(self, shards: list[dict]) -> Iterator:
        for shard in shards:
            path = self.root / shard["name"]
            for key, parts in read_shard(path, shard["samples"], shard.get("members"), shard.get("bytes")):
                if self.raw:
                    yield parts
                    continue
                extension, data = _image_entry(path, key, parts)
                try:
                    label = int(parts["cls"])
                except (KeyError, ValueError):
                    raise ShardError(
                        f"sample {key!r} in shard {path} has no readable label (a .cls entry holding an "
                        "integer); write the shards with gk.data.write_shards."
                    ) from None
                try:
                    image = decode(data, f"sample {key!r} ({extension}) in shard {path}", "." + extension)
                except ValueError as error:
                    raise ShardError(str(error)) from None
                if self.mean is not None:
                    image = (image.float() / 255 - self.mean[:, None, None]) / self.std[:, None, None]
                yield image, label

    def __iter__(self) -> Iterator:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        stream = self._samples(self.worker_shards(worker, workers))
        if self.shuffle and self.shuffle_buffer > 1:
            rng = random.Random(_seed(self.seed, self.epoch, worker + 1))
            stream = _webdataset().shuffle(self.shuffle_buffer, initial=self.shuffle_buffer, rng=rng)(stream)
        return iter(stream)


class ShardLoader:
    """Batches of (normalised float images (B, 3, H, W), labels (B,)) streamed from `write_shards` output.

    Each epoch builds a DataLoader over a ShardDataset for that epoch (workers are started per epoch:
    they must know the epoch to shuffle the same way on a replay). `fit` calls `set_epoch`; iterating
    without it moves to the next epoch by itself, as DeviceLoader does.
    drop_last (default: shuffle) drops each worker's last partial batch, so every batch is full.
    """

    def __init__(
        self,
        root: str | os.PathLike,
        batch_size: int,
        *,
        shuffle: bool = True,
        shuffle_buffer: int = 1000,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool | None = None,
        drop_last: bool | None = None,
        normalize: bool = True,
        seed: int = 0,
    ):
        check_int("batch_size", batch_size)
        check_workers(num_workers, prefetch_factor)
        self.root = Path(root)
        self.index = read_index(self.root, "shards")
        self.shards = self.index["shards"]
        missing = [shard["name"] for shard in self.shards if not (self.root / shard["name"]).is_file()]
        if missing:
            raise ShardError(
                f"shard(s) {', '.join(missing)} listed in {self.root / INDEX} are missing; write the "
                "shards again with gk.data.write_shards."
            )
        if not self.shards or sum(shard["samples"] for shard in self.shards) == 0:
            raise ShardError(f"{self.root} holds no samples; write a non-empty dataset with gk.data.write_shards.")
        self.classes = tuple(self.index["classes"])
        self.samples = sum(shard["samples"] for shard in self.shards)
        self.mean, self.std = torch.tensor(self.index["mean"]), torch.tensor(self.index["std"])
        self.batch_size, self.shuffle, self.shuffle_buffer = batch_size, shuffle, shuffle_buffer
        self.num_workers, self.prefetch_factor = num_workers, prefetch_factor
        if pin_memory is None:
            pin_memory = env.detect().device == "cuda"  # asks NVML: does not initialise CUDA here
        self.pin_memory = pin_memory
        self.drop_last = shuffle if drop_last is None else drop_last
        self.normalize, self.seed, self.epoch = normalize, check_seed(seed), 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def dataset(self, epoch: int | None = None, raw: bool = False) -> ShardDataset:
        return ShardDataset(
            self.root,
            self.shards,
            shuffle=self.shuffle,
            shuffle_buffer=self.shuffle_buffer,
            seed=self.seed,
            epoch=self.epoch if epoch is None else epoch,
            mean=self.mean if self.normalize else None,
            std=self.std,
            raw=raw,
        )

    def __len__(self) -> int:
        """Batches per epoch: each worker batches its own shards (the same for every epoch's shard order
        only when shards hold equal counts; the count here is for this epoch's order)."""
        dataset, workers = self.dataset(), max(self.num_workers, 1)
        total = 0
        for worker in range(workers):
            samples = sum(shard["samples"] for shard in dataset.worker_shards(worker, workers))
            total += samples // self.batch_size if self.drop_last else math.ceil(samples / self.batch_size)
        return total

    def __iter__(self) -> Iterator:
        loader = DataLoader(
            self.dataset(),
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            prefetch_factor=self.prefetch_factor,
            pin_memory=self.pin_memory,
            drop_last=self.drop_last,
        )
        yield from loader
        self.epoch += 1

    def files(self) -> list[Path]:
        return [self.root / shard["name"] for shard in self.shards]

    def read_raw(self, count: int, batch_size: int | None = None) -> int:
        """Read `count` samples' encoded bytes in stream order, without decoding (for read_throughput)."""
        read, batch = 0, []
        for parts in self.dataset(epoch=0, raw=True)._samples(self.shards):
            batch.append(parts)
            read += 1
            if batch_size is None or len(batch) == batch_size:
                batch = []
            if read == count:
                break
        return read

    def __repr__(self) -> str:
        return (
            f"ShardLoader({self.samples} samples in {len(self.shards)} shards at {self.root}, batch_size="
            f"{self.batch_size}, num_workers={self.num_workers}, shuffle_buffer={self.shuffle_buffer})"
        )
