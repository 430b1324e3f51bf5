"""Decode and augment JPEGs: with PIL, with torchvision on the CPU in batches, or on the GPU (nvJPEG).

`decode_table(encoded)` measures images/s for each path on the same JPEG bytes:

    PIL                         one image at a time, Image.open + convert("RGB")
    decode_jpeg, CPU, batched   torchvision.io.decode_jpeg(list of tensors) (libjpeg-turbo)
    decode_jpeg, 1 worker       batched calls in one DataLoader worker process, the pixels kept there
    decode_jpeg, every core     the same in os.cpu_count() workers, at least BATCHES_PER_WORKER batches each:
                                all the CPU can do, the fair match for nvJPEG, with its rate per core and its
                                scaling over the 1-worker row (both skipped when num_workers=0)
    decode_jpeg, CUDA, batched  the same with device="cuda" (nvJPEG): a row that says
                                "skipped: no GPU" where there is none, never a made-up figure
    v2 in DataLoader workers    decode + RandomResizedCrop + flip + ColorJitter per image, in workers
    v2 batched on the device    decode a batch, then the same transforms on the whole batch at once

torchvision decodes a list of JPEGs on the CPU one after another in one thread (a Python loop over
libjpeg-turbo: CPU time equals wall time, measured), so the CPU decode_jpeg row is one thread whatever
torch.get_num_threads() says; nvJPEG decodes the whole list in one batched call.

The decode_jpeg worker rows keep the decoded pixels in the workers (each returns how many images it decoded), as nvJPEG's
stay on the GPU: shipping them would time the copy between processes, not the decoder (a 512×512 RGB image is
0.8 MB; an earlier row that shipped every image gave each of 16 workers one batch of 1,024 images and moved ~0.8 GB
per pass: 179 images/s per core against 440 for one thread, H100 machine, 2026-11-24).

Published figures to hold these against (pytorch/vision#8496, an A100, JPEG photographs of 551×676 on
average): batched decode_jpeg(device="cuda") decoded ~7,700 images/s in batches of 100 (~7,800/s in
batches of 1,000) against ~350–390/s for decode_jpeg on one CPU thread, about 20×; one image at a time
the GPU was only 5× faster. The GPU's cost per call is fixed while the CPU's shrinks with the pixels,
so small images gain less: compare on images of a few hundred pixels a side, in batches.

`photo_jpegs(images, side)` makes test JPEGs that cost what photographs cost to decode; `photo_images(images, side)`
the pixels they encode.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable, Sequence

import torch
from torch.utils.data import DataLoader, Dataset

from ..env import synchronize
from ..report import Table
from . import vision


def _as_tensors(encoded: Sequence[bytes]) -> list[torch.Tensor]:
    return [torch.frombuffer(bytearray(data), dtype=torch.uint8) for data in encoded]


def decode_batch(encoded: Sequence[bytes], device: str | torch.device = "cpu") -> list[torch.Tensor]:
    """JPEG bytes → a list of uint8 RGB images (3, H, W) on `device`, decoded in one batched call.

    device="cuda" decodes on the GPU with nvJPEG; without a CUDA GPU it raises RuntimeError rather than
    falling back silently (decode on the CPU by passing device="cpu").
    """
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(
            "device='cuda' asks for GPU (nvJPEG) decoding, but no CUDA GPU is available here; decode on the CPU with "
            "device='cpu'."
        )
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"decode_jpeg decodes on 'cpu' or 'cuda', not {device.type!r}.")
    io = vision.io()
    return io.decode_jpeg(_as_tensors(encoded), mode=io.ImageReadMode.RGB, device=device)


def photo_images(images: torch.Tensor, side: int, *, grain: float = 8.0, seed: int = 0) -> torch.Tensor:
    """uint8 images (N, 3, H, W) → uint8 images (N, 3, side, side): upscaled (bilinear), with Gaussian grain of std
    `grain` (in 0–255 levels), so that as JPEGs they cost what photographs cost to decode (`photo_jpegs`)."""
    if images.dtype != torch.uint8 or images.dim() != 4:
        raise ValueError(
            f"photo_images and photo_jpegs take uint8 images (N, C, H, W), got {images.dtype} {tuple(images.shape)}."
        )
    upscaled = torch.nn.functional.interpolate(images.float(), size=side, mode="bilinear")
    noise = torch.randn(upscaled.shape, generator=torch.Generator().manual_seed(seed))
    return (upscaled + grain * noise).round().clamp(0, 255).to(torch.uint8)


def photo_jpegs(
    images: torch.Tensor, side: int, *, grain: float = 8.0, quality: int = 90, seed: int = 0
) -> list[bytes]:
    """uint8 images (N, 3, H, W) → JPEG bytes of side×side: `photo_images`, encoded at `quality`, so that they cost
    what photographs cost to decode. The same bytes as `write_shards` or `write_files` of those images store.

    Decoding time grows with the entropy-coded bytes: upscaled synthetic images alone are unnaturally smooth. With
    grain 8 at quality 90 a 512×512 JPEG holds ~77 kB, about what a photograph of that size holds, and decoded at ~800
    images/s on one CPU thread here, against ~1,400/s for the same images without grain (28 kB).
    """
    pixels = photo_images(images, side, grain=grain, seed=seed)
    return [vision.io().encode_jpeg(image, quality=quality).numpy().tobytes() for image in pixels]


def decode_pil(data: bytes) -> torch.Tensor:
    """One JPEG with PIL → uint8 RGB (3, H, W)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return vision.v2().functional.pil_to_tensor(image.convert("RGB"))


def augmentation(size: int):
    """The usual ImageNet-style training augmentation, to `size`×`size` uint8 images (a v2.Compose)."""
    v2 = vision.v2()
    return v2.Compose(
        [
            v2.RandomResizedCrop(size, antialias=True),
            v2.RandomHorizontalFlip(),
            v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4),
        ]
    )


class EncodedImages(Dataset):
    """JPEGs kept encoded in memory, decoded and augmented per image in __getitem__, as a torchvision
    dataset does: (uint8 image (3, size, size), label)."""

    def __init__(self, encoded: Sequence[bytes], size: int, labels: Sequence[int] | torch.Tensor | None = None):
        self.encoded, self.transform = list(encoded), augmentation(size)
        self.labels = torch.as_tensor(labels if labels is not None else [0] * len(self.encoded))
        if len(self.labels) != len(self.encoded):
            raise ValueError(f"got {len(self.labels)} labels for {len(self.encoded)} images.")

    def __len__(self) -> int:
        return len(self.encoded)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        io = vision.io()
        image = io.decode_jpeg(
            torch.frombuffer(bytearray(self.encoded[index]), dtype=torch.uint8), mode=io.ImageReadMode.RGB
        )
        return self.transform(image), self.labels[index]


BATCHES_PER_WORKER = 4  # batches each worker decodes per timed pass: one alone would time its start and its end


class _DecodedInWorker(Dataset):
    """Item i: batch i mod len(batches) decoded in one batched call where the item is fetched (a worker). Sent back:
    how many images it decoded, and when the decoding began and ended (time.perf_counter, seconds: on Linux the
    system's monotonic clock, one clock for every process), not the pixels: the decoder's work alone, as nvJPEG's
    pixels stay on the GPU. The counts and times let a reader check the row's rate with a clock of its own."""

    def __init__(self, batches: Sequence[Sequence[bytes]], items: int):
        self.batches, self.items = list(batches), items
        self.images_per_pass = sum(len(self.batches[index % len(self.batches)]) for index in range(items))

    def __len__(self) -> int:
        return self.items

    def __getitem__(self, index: int) -> tuple[int, float, float]:
        started = time.perf_counter()
        decoded = len(decode_batch(self.batches[index % len(self.batches)]))
        return decoded, started, time.perf_counter()


class _AugmentedInWorker(Dataset):
    """EncodedImages' item i (decoded and augmented per image, where the item is fetched: a worker), with when that
    began and ended (time.perf_counter, seconds, as _DecodedInWorker's): (image, label, started, ended). The pixels
    go to the parent, as a training loader's do; the times let a reader count the images the workers decoded."""

    def __init__(self, images: EncodedImages):
        self.images = images

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
        started = time.perf_counter()
        image, label = self.images[index]
        return image, label, started, time.perf_counter()


def _augment_batch(images: list[torch.Tensor], size: int) -> torch.Tensor:
    """Resize, then crop, flip and jitter a whole batch at once. transforms.v2 on a batched tensor draws
    one set of random parameters for the whole batch (per-image crops and flips on a batch:
    gk.data.random_crop_flip)."""
    resize = vision.v2().functional.resize
    batch = torch.stack([resize(image, [size, size], antialias=True) for image in images])
    return augmentation(size)(batch)


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


def _best_pass(run, count: int, repeats: int, clock: Callable[[], float]) -> tuple[float, object]:
    """The best images/s of `repeats` passes of `run` over `count` images by `clock`, and what that pass returned."""
    passes = []
    for _ in range(repeats):
        started = clock()
        result = run()
        passes.append((_rate(count, clock() - started), result))
    return max(passes, key=lambda rate_result: rate_result[0])


def _as_the_workers_counted(run, result) -> dict:
    """For a row decoded in worker processes (_DecodedInWorker, _AugmentedInWorker): the images its best pass's
    workers said they decoded, and the seconds from the first decode's start to the last one's end by their clock;
    {} for others."""
    dataset = getattr(run, "dataset", None)
    if isinstance(dataset, _DecodedInWorker):
        counts, starts, ends = zip(*result)
        return {"decoded_in_workers": sum(counts), "worker_seconds": max(ends) - min(starts)}
    if isinstance(dataset, _AugmentedInWorker):  # batches of (images, labels, started (B,), ended (B,)): one per image
        starts, ends = torch.cat([batch[2] for batch in result]), torch.cat([batch[3] for batch in result])
        return {"decoded_in_workers": len(starts), "worker_seconds": float(ends.max() - starts.min())}
    return {}


def _each(chunks, work, device: torch.device) -> None:
    """`work` on every chunk, then wait for the device: a GPU pass is timed to its end."""
    for chunk in chunks:
        work(chunk)
    synchronize(device)


class _PerImageInWorkers:
    """Passes over a DataLoader that decodes (and augments) in `workers` processes; `warm_up()` starts the
    workers just before this row is timed, so that their start-up is not in its rate. `images_per_pass`: the images
    one pass decodes; batch_size None: each of the dataset's items is a whole batch already."""

    def __init__(self, dataset: Dataset, batch_size: int | None, workers: int):
        self.dataset, self.batch_size, self.workers = dataset, batch_size, workers
        self.images_per_pass = getattr(dataset, "images_per_pass", len(dataset))
        self.loader = None

    def warm_up(self) -> None:
        self.loader = DataLoader(
            self.dataset, batch_size=self.batch_size, num_workers=self.workers, persistent_workers=self.workers > 0
        )
        next(iter(self.loader))

    def __call__(self) -> list:
        return list(self.loader)

    def close(self) -> None:
        self.loader = None  # its persistent workers exit with it


ONE_WORKER = "decode_jpeg, batched, 1 DataLoader worker, pixels kept in the worker"


def _decoding_workers(chunks: list, workers: int) -> _PerImageInWorkers:
    """Batched decoding in `workers` processes, at least BATCHES_PER_WORKER batches each per pass."""
    return _PerImageInWorkers(_DecodedInWorker(chunks, max(len(chunks), BATCHES_PER_WORKER * workers)), None, workers)


def _note_per_core(rows: list[dict], every_core: str, cores: int) -> None:
    """The every-core row's rate per core, and its scaling: its rate ÷ (cores × the 1-worker row's rate)."""
    rate = {row["path"]: row["images_per_second"] for row in rows if row["device"] == "cpu"}
    if rate.get(every_core) and rate.get(ONE_WORKER):
        per_core = rate[every_core] / cores
        rows[[row["path"] for row in rows].index(every_core)]["note"] = (
            f"{per_core:,.0f} images/s per core: {per_core / rate[ONE_WORKER]:.0%} of the 1-worker row's rate; "
            f"at least {BATCHES_PER_WORKER} batches per worker"
        )


def decode_table(
    encoded: Sequence[bytes],
    *,
    size: int,
    batch_size: int = 64,
    num_workers: int = 2,
    repeats: int = 2,
    gpu: bool | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> Table:
    """images/s of every decode and augment path on the same JPEG bytes (see the module docstring).

    Each row is the best of `repeats` passes over `encoded`; CPU rows state the processes and threads
    they used. The three rows decoded in worker processes also hold, not shown, the images that pass's workers said
    they decoded (`decoded_in_workers`) and the seconds between their first decode's start and their last one's end
    by the workers' own clock (`worker_seconds`): the rate again, counted and timed apart from the row's. Rows that need a CUDA GPU say "skipped: no GPU" where there is none. gpu: None measures
    the CUDA rows where a CUDA GPU is present; False skips them ("skipped: gpu=False"); True requires them.
    clock: seconds, read before and after each pass of the rows decoded in this process: the wall clock;
    `time.thread_time` counts only this thread's CPU time, which other programs on the machine do not inflate (the
    decode rows run in this one thread; the batched augment row counts only this thread's share where
    torch.get_num_threads() > 1). Rows decoded in worker processes (their work is not this thread's) and
    CUDA rows (the GPU's is not either) are timed by the wall clock, time.perf_counter, whatever `clock` is.
    """
    if not encoded:
        raise ValueError("no JPEG bytes to decode: pass a non-empty list (e.g. from gk.data.formats.encode).")
    if gpu and not torch.cuda.is_available():
        raise ValueError("decode_table(gpu=True) needs a CUDA GPU and there is none here; pass gpu=None or False.")
    cuda = torch.cuda.is_available() if gpu is None else gpu
    device = torch.device("cuda") if cuda else None
    chunks = [encoded[start : start + batch_size] for start in range(0, len(encoded), batch_size)]
    threads, workers, cores = torch.get_num_threads(), min(num_workers, os.cpu_count() or 1), os.cpu_count() or 1
    augment = "decode batched + transforms.v2 on the batch"
    every_core = f"decode_jpeg, batched, {cores} DataLoader workers (every core), pixels kept in the workers"
    cases = [  # (path, device, CPU cores used, one pass over the images)
        ("PIL, one image at a time", "cpu", "1 process, 1 thread", lambda: [decode_pil(data) for data in encoded]),
        ("decode_jpeg, batched", "cpu", "1 process, 1 thread", lambda: [decode_batch(chunk) for chunk in chunks]),
        (ONE_WORKER, "cpu", "1 worker process, 1 thread", _decoding_workers(chunks, 1)),
        (every_core, "cpu", f"{cores} worker processes, 1 thread each", _decoding_workers(chunks, cores)),
        ("decode_jpeg, batched", "cuda", "1 process", lambda: _each(chunks, lambda c: decode_batch(c, device), device)),
        (f"decode + transforms.v2 per image, {workers} DataLoader workers", "cpu",
         f"{workers} worker processes, 1 thread each",
         _PerImageInWorkers(_AugmentedInWorker(EncodedImages(encoded, size)), batch_size, workers)),
        (augment, "cpu", "1 process, 1 thread" if threads == 1 else f"1 process, up to {threads} threads",
         lambda: [_augment_batch(decode_batch(chunk), size) for chunk in chunks]),
        (augment, "cuda", "1 process", lambda: _each(chunks, lambda c: _augment_batch(decode_batch(c, device), size),
                                                     device)),
    ]  # fmt: skip
    if cuda:
        decode_batch(encoded[:batch_size], device)  # initialise nvJPEG before timing
    skipped = "skipped: no GPU" if gpu is None else "skipped: gpu=False"
    rows = []
    for path, where, used, run in cases:
        row = {"path": path, "device": where, "cpu_cores_used": used if where == "cpu" or cuda else "-"}
        if where == "cuda" and not cuda:
            rows.append(row | {"images_per_second": None, "note": skipped})
        elif num_workers == 0 and isinstance(run, _PerImageInWorkers) and run.workers > 0:
            rows.append(row | {"images_per_second": None, "note": "skipped: num_workers=0 (no worker processes)"})
        else:
            getattr(run, "warm_up", lambda: None)()
            timer = time.perf_counter if where == "cuda" or isinstance(run, _PerImageInWorkers) else clock
            rate, result = _best_pass(run, getattr(run, "images_per_pass", len(encoded)), repeats, timer)
            rows.append(row | {"images_per_second": rate} | _as_the_workers_counted(run, result))
            getattr(run, "close", lambda: None)()  # worker processes end before the next row is timed
    for row in rows:
        row.setdefault("note", "")
    _note_per_core(rows, every_core, cores)
    shape = decode_batch(encoded[:1])[0].shape
    return Table(
        rows,
        ["path", "device", "cpu_cores_used", "images_per_second", "note"],  # the workers' own counts: rows only
        title=f"decode and augment {len(encoded)} JPEGs of {shape[1]}×{shape[2]} to {size}×{size}, batches "
        f"of {batch_size}, {os.cpu_count()} CPU cores here",
    )
