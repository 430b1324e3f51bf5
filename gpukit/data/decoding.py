"""Decode and augment JPEGs: with PIL, with torchvision on the CPU in batches, or on the GPU (nvJPEG).

`decode_table(encoded)` measures images/s for each path on the same JPEG bytes:

    PIL                         one image at a time, Image.open + convert("RGB")
    decode_jpeg, CPU, batched   torchvision.io.decode_jpeg(list of tensors) (libjpeg-turbo)
    decode_jpeg, CUDA, batched  the same with device="cuda" (nvJPEG): a row that says
                                "skipped: no GPU" where there is none, never a made-up figure
    v2 in DataLoader workers    decode + RandomResizedCrop + flip + ColorJitter per image, in workers
    v2 batched on the device    decode a batch, then the same transforms on the whole batch at once

Published figures to hold these against: batched decode_jpeg(device="cuda") on an A100 decoded
~7,800 images/s against ~390/s on one CPU thread (pytorch/vision#8496).
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Sequence

import torch
from torch.utils.data import DataLoader, Dataset
from torchvision.io import ImageReadMode, decode_jpeg
from torchvision.transforms import v2

from ..report import Table


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
    return decode_jpeg(_as_tensors(encoded), mode=ImageReadMode.RGB, device=device)


def decode_pil(data: bytes) -> torch.Tensor:
    """One JPEG with PIL → uint8 RGB (3, H, W)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return v2.functional.pil_to_tensor(image.convert("RGB"))


def augmentation(size: int) -> v2.Compose:
    """The usual ImageNet-style training augmentation, to `size`×`size` uint8 images."""
    return v2.Compose([
        v2.RandomResizedCrop(size, antialias=True), v2.RandomHorizontalFlip(),
        v2.ColorJitter(brightness=0.4, contrast=0.4, saturation=0.4),
    ])  # fmt: skip


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
        image = decode_jpeg(torch.frombuffer(bytearray(self.encoded[index]), dtype=torch.uint8), mode=ImageReadMode.RGB)
        return self.transform(image), self.labels[index]


def _augment_batch(images: list[torch.Tensor], size: int) -> torch.Tensor:
    """Resize, then crop, flip and jitter a whole batch at once. transforms.v2 on a batched tensor draws
    one set of random parameters for the whole batch (per-image crops and flips on a batch:
    gk.data.random_crop_flip)."""
    batch = torch.stack([v2.functional.resize(image, [size, size], antialias=True) for image in images])
    return augmentation(size)(batch)


def _rate(count: int, seconds: float) -> float:
    return count / seconds if seconds > 0 else float("nan")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_table(encoded: Sequence[bytes], *, size: int, batch_size: int = 64, num_workers: int = 2,
                 repeats: int = 2, gpu: bool | None = None) -> Table:  # fmt: skip
    """images/s of every decode and augment path on the same JPEG bytes (see the module docstring).

    Each row is the best of `repeats` passes over `encoded`; CPU rows state the processes and threads
    they used. Rows that need a CUDA GPU say "skipped: no GPU" where there is none. gpu: None measures
    the CUDA rows where a CUDA GPU is present; False skips them ("skipped: gpu=False"); True requires them.
    """
    if not encoded:
        raise ValueError("no JPEG bytes to decode: pass a non-empty list (e.g. from gk.data.formats.encode).")
    if gpu and not torch.cuda.is_available():
        raise ValueError("decode_table(gpu=True) needs a CUDA GPU and there is none here; pass gpu=None or False.")
    threads = torch.get_num_threads()
    cuda = torch.cuda.is_available() if gpu is None else gpu
    skipped = "skipped: no GPU" if gpu is None else "skipped: gpu=False"
    gpu = torch.device("cuda") if cuda else None
    count = len(encoded)

    def best(run) -> float:
        rates = []
        for _ in range(repeats):
            started = time.perf_counter()
            run()
            rates.append(_rate(count, time.perf_counter() - started))
        return max(rates)

    def batches():
        for start in range(0, count, batch_size):
            yield encoded[start : start + batch_size]

    rows = [
        {"path": "PIL, one image at a time", "device": "cpu", "cpu_cores_used": "1 process, 1 thread",
         "images_per_second": best(lambda: [decode_pil(data) for data in encoded])},
        {"path": "decode_jpeg, batched", "device": "cpu", "cpu_cores_used": f"1 process, up to {threads} threads",
         "images_per_second": best(lambda: [decode_batch(chunk) for chunk in batches()])},
    ]  # fmt: skip
    if cuda:
        decode_batch(encoded[:batch_size], gpu)  # initialise nvJPEG before timing

        def on_gpu():
            for chunk in batches():
                decode_batch(chunk, gpu)
            _sync(gpu)

        rows.append({"path": "decode_jpeg, batched", "device": "cuda", "cpu_cores_used": "1 process",
                     "images_per_second": best(on_gpu)})  # fmt: skip
    else:
        rows.append({"path": "decode_jpeg, batched", "device": "cuda", "cpu_cores_used": "-",
                     "images_per_second": None, "note": skipped})  # fmt: skip

    workers = min(num_workers, os.cpu_count() or 1)
    loader = DataLoader(EncodedImages(encoded, size), batch_size=batch_size, num_workers=workers,
                        persistent_workers=workers > 0)  # fmt: skip
    next(iter(loader))  # start the workers before timing
    rows.append({"path": f"decode + transforms.v2 per image, {workers} DataLoader workers", "device": "cpu",
                 "cpu_cores_used": f"{workers} worker processes, 1 thread each",
                 "images_per_second": best(lambda: [batch for batch in loader])})  # fmt: skip

    rows.append({"path": "decode batched + transforms.v2 on the batch", "device": "cpu",
                 "cpu_cores_used": f"1 process, up to {threads} threads",
                 "images_per_second": best(lambda: [_augment_batch(decode_batch(chunk), size) for chunk in batches()])})  # fmt: skip
    if cuda:

        def augment_on_gpu():
            for chunk in batches():
                _augment_batch(decode_batch(chunk, gpu), size)
            _sync(gpu)

        rows.append({"path": "decode batched + transforms.v2 on the batch", "device": "cuda",
                     "cpu_cores_used": "1 process", "images_per_second": best(augment_on_gpu)})  # fmt: skip
    else:
        rows.append({"path": "decode batched + transforms.v2 on the batch", "device": "cuda", "cpu_cores_used": "-",
                     "images_per_second": None, "note": skipped})  # fmt: skip
    for row in rows:
        row.setdefault("note", "")
    shape = decode_batch(encoded[:1])[0].shape
    return Table(rows, title=f"decode and augment {count} JPEGs of {shape[1]}×{shape[2]} to {size}×{size}, "
                             f"{os.cpu_count()} CPU cores here")  # fmt: skip
