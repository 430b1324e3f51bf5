"""An image dataset stored three ways on disk, and how fast each reads, cold and warm.

- `write_files(dataset, root)`: one JPEG or PNG file per image, in class folders (what `image_folder`
  reads, and how most datasets arrive). `FileImages(root)` reads them back.
- `write_shards(dataset, root)` (gpukit.data.shards): the encoded images packed into WebDataset tar
  shards of a few MB each. `ShardLoader(root, batch_size)` streams them.
- `write_array(dataset, root)`: the decoded images as one uint8 array (N, C, H, W) in a .npy file,
  read through a memory map. `ArrayImages(root)` reads it: no decoding at all, but 10-20× the bytes
  of JPEG.

`read_throughput(store)` reads every sample of one of these, cold (the files evicted from the page
cache first, and the eviction checked) or warm, one sample at a time in random order or in batches,
and reports samples/s, MB/s and the bytes on disk. Reading here means getting each sample's bytes
into memory; decoding is measured separately (gpukit.data.decoding).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..files import write_atomic
from . import vision
from .images import ImageDataset
from .pagecache import can_evict, evict, resident_bytes

IMAGE_FORMATS = {"jpeg": ".jpg", "png": ".png"}
DECODABLE = (".jpg", ".jpeg", ".png")  # what torchvision.io.decode_image reads here, compared in lower case
INDEX = ".index.json"  # written last into every store folder (hidden: image_folder skips it); complete when present


def _check_dataset(dataset) -> None:
    if not isinstance(dataset, ImageDataset):
        raise TypeError(
            f"expected an ImageDataset (gk.data.shapes(), cifar10() or image_folder()), got {type(dataset).__name__}."
        )
    if len(dataset) == 0:
        raise ValueError("the dataset is empty: there is nothing to write.")


def encode(image: torch.Tensor, format: str = "jpeg", quality: int = 90) -> bytes:
    """One uint8 image (C, H, W) as JPEG or PNG bytes."""
    if format not in IMAGE_FORMATS:
        raise ValueError(f"format={format!r} is unknown; use one of {', '.join(map(repr, IMAGE_FORMATS))}.")
    io = vision.io()
    data = io.encode_jpeg(image, quality=quality) if format == "jpeg" else io.encode_png(image)
    return data.numpy().tobytes()


def decode(data: bytes, name: str, suffix: str | None = None) -> torch.Tensor:
    """JPEG or PNG bytes → uint8 RGB (3, H, W); ValueError naming `name` if they are not a readable image.

    suffix: the format's file extension (".jpg"); default the extension of `name`.
    """
    suffix = (suffix if suffix is not None else Path(name).suffix).lower()
    if suffix not in DECODABLE:
        raise ValueError(
            f"cannot decode {name}: {suffix or 'no extension'} is not an image format this loader reads "
            f"({', '.join(DECODABLE)}); convert the file to JPEG or PNG, or remove it."
        )
    try:
        io = vision.io()
        return io.decode_image(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=io.ImageReadMode.RGB)
    except RuntimeError as error:  # torchvision reports corrupt or truncated data as RuntimeError
        raise ValueError(f"cannot decode {name}: the data is corrupt or truncated ({error}).") from None


def _metadata(dataset: ImageDataset, kind: str, **extra) -> dict:
    return {
        "kind": kind,
        "samples": len(dataset),
        "classes": list(dataset.classes),
        "mean": dataset.mean.tolist(),
        "std": dataset.std.tolist(),
        "shape": list(dataset.images.shape[1:]),
    } | extra


def _fresh_folder(root: Path) -> Path:
    """A temporary sibling of `root` to write into; renamed over `root` when complete (no half-written store)."""
    temporary = root.with_name(f".{root.name}.{os.getpid()}.tmp")
    shutil.rmtree(temporary, ignore_errors=True)
    temporary.mkdir(parents=True)
    return temporary


def _publish(temporary: Path, root: Path) -> Path:
    if root.exists():
        shutil.rmtree(root)
    os.replace(temporary, root)
    return root


def write_files(dataset: ImageDataset, root: str | os.PathLike, *, format: str = "jpeg", quality: int = 90) -> Path:
    """Every image as its own file: root/<class name>/<index>.jpg (or .png), the layout `image_folder` reads.

    Written into a temporary folder that replaces `root` when complete.
    """
    _check_dataset(dataset)
    suffix = IMAGE_FORMATS.get(format)
    if suffix is None:
        raise ValueError(f"format={format!r} is unknown; use one of {', '.join(map(repr, IMAGE_FORMATS))}.")
    root = Path(root)
    temporary = _fresh_folder(root)
    for name in dataset.classes:
        (temporary / name).mkdir()
    for index, (image, label) in enumerate(zip(dataset.images, dataset.labels.tolist())):
        (temporary / dataset.classes[label] / f"{index:07d}{suffix}").write_bytes(encode(image, format, quality))
    write_atomic(temporary / INDEX, json.dumps(_metadata(dataset, "files", format=format)).encode())
    return _publish(temporary, root)


def write_array(dataset: ImageDataset, root: str | os.PathLike) -> Path:
    """The decoded images as root/images.npy (uint8, N×C×H×W) and the labels as root/labels.npy."""
    _check_dataset(dataset)
    root = Path(root)
    temporary = _fresh_folder(root)
    images = np.lib.format.open_memmap(
        temporary / "images.npy", mode="w+", dtype=np.uint8, shape=tuple(dataset.images.shape)
    )
    images[:] = dataset.images.numpy()
    images.flush()
    del images
    np.save(temporary / "labels.npy", dataset.labels.numpy())
    write_atomic(temporary / INDEX, json.dumps(_metadata(dataset, "array")).encode())
    return _publish(temporary, root)


def read_index(root: str | os.PathLike, kind: str) -> dict:
    """The index of a store written by write_files, write_shards or write_array; clear errors if it is not one."""
    root = Path(root)
    writer = {"files": "write_files", "shards": "write_shards", "array": "write_array"}[kind]
    if not root.is_dir():
        raise FileNotFoundError(f"no folder {root}: write it first with gk.data.{writer}(dataset, {str(root)!r}).")
    index_path = root / INDEX
    if not index_path.is_file():
        raise FileNotFoundError(
            f"{root} has no {INDEX}, so it is not a complete store (interrupted while writing, or not written by "
            f"gpukit): write it again with gk.data.{writer}(dataset, {str(root)!r})."
        )
    index = json.loads(index_path.read_text())
    if index.get("kind") != kind:
        raise ValueError(f"{root} holds a {index.get('kind')!r} store, not {kind!r}.")
    return index


class FileImages(Dataset):
    """The images of a `write_files` folder (or any root/<class>/<file> folder with an index): one file each."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.index = read_index(self.root, "files")
        self.classes = tuple(self.index["classes"])
        self.paths, self.labels = [], []
        for label, name in enumerate(self.classes):
            for path in sorted((self.root / name).iterdir()):
                if path.name.startswith("."):
                    continue
                if path.suffix.lower() not in DECODABLE:
                    raise ValueError(
                        f"cannot decode {path}: {path.suffix or 'no extension'} is not an image format this loader "
                        f"reads ({', '.join(DECODABLE)}); convert it to JPEG or PNG, or move it out of {self.root}."
                    )
                self.paths.append(path)
                self.labels.append(label)

    def __len__(self) -> int:
        return len(self.paths)

    def read(self, index: int) -> bytes:
        with open(self.paths[index], "rb") as file:
            return file.read()

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        """(uint8 image (3, H, W), label)."""
        return decode(self.read(index), str(self.paths[index])), self.labels[index]

    def files(self) -> list[Path]:
        return list(self.paths)


class ArrayImages(Dataset):
    """The images of a `write_array` folder, read through a memory map: only the rows asked for are read."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.index = read_index(self.root, "array")
        self.classes = tuple(self.index["classes"])
        self._images = None
        self.labels = torch.from_numpy(np.load(self.root / "labels.npy"))

    @property
    def images(self) -> np.memmap:
        """The (N, C, H, W) uint8 array, memory-mapped on first use."""
        if self._images is None:
            self._images = np.load(self.root / "images.npy", mmap_mode="r")
        return self._images

    def close(self) -> None:
        """Unmap the array: pages a live mapping uses stay in the page cache even when evicted."""
        self._images = None

    def __getstate__(self) -> dict:  # DataLoader workers map the file themselves
        return self.__dict__ | {"_images": None}

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.from_numpy(np.array(self.images[index])), self.labels[index]

    def batch(self, indices) -> tuple[torch.Tensor, torch.Tensor]:
        """Many rows in one read: sorted indices make the reads sequential on disk."""
        indices = np.sort(np.asarray(indices))
        return torch.from_numpy(self.images[indices]), self.labels[indices]

    def files(self) -> list[Path]:
        return [self.root / "images.npy", self.root / "labels.npy"]


def store_bytes(files) -> int:
    """Bytes on disk of a store's files (their sizes; whole blocks may take a little more)."""
    return sum(Path(path).stat().st_size for path in files)


def read_throughput(
    store,
    *,
    cold: bool,
    batch_size: int | None = None,
    limit: int | None = None,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
) -> dict:
    """Read the samples of a FileImages, ArrayImages or ShardLoader store and time it.

    cold: evict the store's files from the page cache first and check that it worked
        (`resident_before` is the fraction of its bytes still cached; None where unknown).
    batch_size: None reads one sample per call in random order (shards: in stream order, the only
        order a tar stream has); a number reads that many per call (array: one sorted fancy-index).
    limit: read only this many samples (the first ones of a random order).
    clock: seconds, read before and after the reads: the wall clock; `time.thread_time` counts only this thread's
        CPU time (reading from the page cache is CPU work), which other programs on the machine do not inflate.
    Returns samples, seconds, samples/s, MB/s (of the bytes on disk per sample read), bytes on disk.
    """
    files = store.files()
    on_disk = store_bytes(files)
    resident = None
    if hasattr(store, "close"):
        store.close()
    if cold:
        evict(files)
        cached = resident_bytes(files)
        resident = cached / max(on_disk, 1) if cached is not None and can_evict() else None
    samples = getattr(store, "samples", None) or len(store)
    count = samples if limit is None else min(limit, samples)
    order = list(range(samples))
    random.Random(seed).shuffle(order)
    order = order[:count]
    started = clock()
    read = _read_samples(store, order, batch_size)
    seconds = clock() - started
    megabytes = on_disk / 1e6 * read / samples
    return {
        "samples": read,
        "seconds": seconds,
        "samples_per_second": read / seconds,
        "megabytes_per_second": megabytes / seconds,
        "bytes_on_disk": on_disk,
        "resident_before": resident,
    }


def _read_samples(store, order: list[int], batch_size: int | None) -> int:
    if isinstance(store, FileImages):  # every sample is its own file: one open and read each, batched or not
        for index in order:
            store.read(index)
        return len(order)
    if isinstance(store, ArrayImages):
        if batch_size is None:
            for index in order:
                np.array(store.images[index])
        else:
            for start in range(0, len(order), batch_size):
                store.batch(order[start : start + batch_size])
        return len(order)
    if hasattr(store, "read_raw"):  # a ShardLoader: a sequential stream of encoded samples
        return store.read_raw(len(order), batch_size)
    raise TypeError(f"expected a FileImages, ArrayImages or ShardLoader, got {type(store).__name__}.")
