"""Image datasets kept as one uint8 tensor.

- `ImageDataset`: images (N, C, H, W) as uint8, labels, class names, normalisation; boxes where known.
- `DetectionDataset`: an ImageDataset with boxes as a detector takes it: (image, {"boxes", "labels"}).
- `shapes()`: a synthetic, deterministic, offline 10-class image dataset (32×32 RGB), with each shape's box.
- `cifar10()`: CIFAR-10 through torchvision, stored under `data/`.
"""

from __future__ import annotations

import math
import socket
import urllib.error
from pathlib import Path

import torch
from torch.utils.data import Dataset

SHAPE_CLASSES = (
    "disk",
    "ring",
    "square",
    "frame",
    "triangle",
    "cross",
    "bar",
    "star",
    "half-disk",
    "two-dots",
)
CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"


class ImageDataset(Dataset):
    """Images kept as one uint8 tensor of shape (N, C, H, W), labels as int64 of shape (N,).

    `mean` and `std` (per channel, in 0..1 units) are what loaders normalise with.
    Indexing returns a normalised float image and its label, like a torchvision dataset.
    `boxes` (optional, float32 (N, 4)): each image's object as (x1, y1, x2, y2) in pixels, the corners
    of the smallest box holding it (torchvision's box format); `detection()` serves them to a detector.
    """

    def __init__(
        self, images: torch.Tensor, labels: torch.Tensor, classes, mean=None, std=None, transform=None, boxes=None
    ):
        if images.dtype != torch.uint8 or images.dim() != 4:
            raise ValueError(f"images must be uint8 of shape (N, C, H, W), got {images.dtype} {tuple(images.shape)}.")
        if labels.shape != (images.shape[0],):
            raise ValueError(f"labels must have shape ({images.shape[0]},), got {tuple(labels.shape)}.")
        if boxes is not None and boxes.shape != (images.shape[0], 4):
            raise ValueError(f"boxes must have shape ({images.shape[0]}, 4), got {tuple(boxes.shape)}.")
        self.images = images
        self.boxes = None if boxes is None else boxes.float()
        self.labels = labels.long()
        self.classes = tuple(classes)
        if len(self.labels) and (self.labels.min() < 0 or self.labels.max() >= len(self.classes)):
            raise ValueError(
                f"labels must lie in 0..{len(self.classes) - 1} for {len(self.classes)} classes, "
                f"found {int(self.labels.min())}..{int(self.labels.max())}; fix the labels or the class list."
            )
        floats = images.float().div_(255) if mean is None or std is None else None
        self.mean = torch.as_tensor(mean if mean is not None else floats.mean((0, 2, 3)), dtype=torch.float32)
        std = torch.as_tensor(std if std is not None else floats.std((0, 2, 3)), dtype=torch.float32)
        self.std = std.clamp_min(1 / 255)  # a channel that never varies (all-zero green, say) must not divide by 0
        self.transform = transform  # optional per-image transform on a float image (C, H, W)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image = (self.images[index].float() / 255 - self.mean[:, None, None]) / self.std[:, None, None]
        if self.transform is not None:
            image = self.transform(image)
        return image, self.labels[index]

    def subset(self, count: int) -> ImageDataset:
        """The first `count` images, with this dataset's normalisation."""
        return ImageDataset(
            self.images[:count], self.labels[:count], self.classes, self.mean, self.std, boxes=self._boxes(count)
        )

    def _boxes(self, index) -> torch.Tensor | None:
        """The boxes of the images `index` picks (a count from the start, or a tensor of indices), if known."""
        if self.boxes is None:
            return None
        return self.boxes[:index] if isinstance(index, int) else self.boxes[index]

    def detection(self) -> DetectionDataset:
        """This dataset as a detector takes it: (image, {"boxes", "labels"}); needs boxes (gk.data.shapes has them)."""
        if self.boxes is None:
            raise ValueError(
                "this ImageDataset has no boxes, so it cannot serve a detector: gk.data.shapes() draws its shapes "
                "with their boxes; for your own images, pass boxes= (N, 4) as (x1, y1, x2, y2) in pixels."
            )
        return DetectionDataset(self)

    def split(self, held_out: float = 0.2, seed: int = 0) -> tuple[ImageDataset, ImageDataset]:
        """(train, held_out) parts, drawn at random within each class so both keep the class balance.

        Each class puts round(held_out × its count) images, at least one and at most all but one, in
        the held-out part. The same seed gives the same split. Both parts keep the original order and
        normalise with the training part's mean and std, so nothing about the held-out images leaks
        into training. `transform` is not carried over: set it on the part that needs it.
        """
        if not 0 < held_out < 1:
            raise ValueError(f"held_out is the fraction of images to hold out and must lie in (0, 1), got {held_out}.")
        generator = torch.Generator().manual_seed(seed)
        train_index, held_out_index = [], []
        for label, name in enumerate(self.classes):
            members = (self.labels == label).nonzero().squeeze(1)
            if len(members) < 2:
                raise ValueError(
                    f"Class {name!r} has {len(members)} image(s), but split needs at least 2 per class (one for "
                    "each part). Add images of that class, or leave the class out."
                )
            members = members[torch.randperm(len(members), generator=generator)]
            count = min(max(round(held_out * len(members)), 1), len(members) - 1)
            held_out_index.append(members[:count])
            train_index.append(members[count:])
        train_index, held_out_index = torch.cat(train_index).sort().values, torch.cat(held_out_index).sort().values
        train = ImageDataset(
            self.images[train_index], self.labels[train_index], self.classes, boxes=self._boxes(train_index)
        )
        held = ImageDataset(
            self.images[held_out_index],
            self.labels[held_out_index],
            self.classes,
            train.mean,
            train.std,
            boxes=self._boxes(held_out_index),
        )
        return train, held

    def __repr__(self) -> str:
        shape = "×".join(map(str, self.images.shape[1:]))
        return f"ImageDataset({len(self)} images of {shape}, {len(self.classes)} classes)"


class DetectionDataset(Dataset):
    """An ImageDataset with boxes, as torchvision's detectors take it: item i is (image, target), the image
    normalised float (C, H, W), the target {"boxes": float32 (1, 4), "labels": int64 (1,)}: one object per
    image. Labels are the class + 1: torchvision's detectors keep label 0 for the background, so build them
    with num_classes = len(dataset.classes) + 1. Batch with DataLoader(..., collate_fn=gk.data.collate_lists),
    which keeps images and targets as lists (a detector's images may differ in size, its targets in boxes).
    """

    def __init__(self, images: ImageDataset):
        self.images = images
        self.classes = images.classes

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        image, label = self.images[index]
        return image, {"boxes": self.images.boxes[index : index + 1].clone(), "labels": (label + 1).reshape(1)}

    def __repr__(self) -> str:
        return f"DetectionDataset({len(self)} images with one box each, {len(self.classes)} classes + background)"


# ---------------------------------------------------------------------------------------------
# Synthetic shapes


def _triangle(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    inside = torch.ones_like(u, dtype=torch.bool)
    for k in range(3):  # an equilateral triangle: inside three half-planes
        angle = math.radians(-90 + 120 * k)
        inside &= u * math.cos(angle) + v * math.sin(angle) < 0.5
    return inside


def _box(u, v):
    return torch.maximum(u.abs(), v.abs())


# Each shape as a mask in shape coordinates (u, v), unit size, centred at 0.
_SHAPE_MASKS = (
    lambda u, v: u * u + v * v < 1.0,  # disk
    lambda u, v: ((u * u + v * v) > 0.55**2) & ((u * u + v * v) < 1.0),  # ring
    lambda u, v: _box(u, v) < 0.8,  # square
    lambda u, v: (_box(u, v) > 0.5) & (_box(u, v) < 0.85),  # frame
    _triangle,
    lambda u, v: ((u.abs() < 0.3) & (v.abs() < 0.95)) | ((v.abs() < 0.3) & (u.abs() < 0.95)),  # cross
    lambda u, v: (u.abs() < 0.95) & (v.abs() < 0.25),  # bar
    lambda u, v: torch.sqrt(u * u + v * v) < 0.55 + 0.4 * torch.cos(5 * torch.atan2(v, u)),  # star
    lambda u, v: (u * u + v * v < 1.0) & (v > 0),  # half-disk
    lambda u, v: ((u - 0.55) ** 2 + v * v < 0.35**2) | ((u + 0.55) ** 2 + v * v < 0.35**2),  # two dots
)


def _shape_masks(labels: torch.Tensor, u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Boolean masks (N, H, W): each image's shape, computed only for the images of its class."""
    masks = torch.empty_like(u, dtype=torch.bool)
    for label, shape in enumerate(_SHAPE_MASKS):
        index = (labels == label).nonzero().squeeze(1)
        masks[index] = shape(u[index], v[index])
    return masks


def _bounding_boxes(mask: torch.Tensor) -> torch.Tensor:
    """(N, 4) float32 boxes (x1, y1, x2, y2) in pixels around each mask (N, H, W): from the first row and column
    the shape covers to the end of the last (a pixel spans [i, i + 1))."""

    def span(covered: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # covered: (N, L) bool
        index = torch.arange(covered.shape[1])
        first = torch.where(covered, index, covered.shape[1]).amin(1)
        last = torch.where(covered, index, -1).amax(1)
        return first, last + 1

    (x1, x2), (y1, y2) = span(mask.any(1)), span(mask.any(2))
    return torch.stack([x1, y1, x2, y2], dim=1).float()


def _render_shapes(
    count: int, generator: torch.Generator, size: int = 32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    def uniform(*shape, low=0.0, high=1.0):
        return torch.rand(*shape, generator=generator) * (high - low) + low

    labels = torch.randint(0, len(SHAPE_CLASSES), (count,), generator=generator)
    scale = uniform(count, low=0.18 * size, high=0.36 * size)  # shape radius in pixels
    margin = scale * 0.6
    cx = uniform(count) * (size - 2 * margin) + margin
    cy = uniform(count) * (size - 2 * margin) + margin
    angle = uniform(count, high=2 * math.pi)
    grid = torch.arange(size, dtype=torch.float32) + 0.5
    dx = grid[None, None, :] - cx[:, None, None]  # (N, 1, W)
    dy = grid[None, :, None] - cy[:, None, None]  # (N, H, 1)
    cos, sin = torch.cos(angle)[:, None, None], torch.sin(angle)[:, None, None]
    u = (dx * cos + dy * sin) / scale[:, None, None]
    v = (-dx * sin + dy * cos) / scale[:, None, None]
    mask = _shape_masks(labels, u, v).unsqueeze(1)  # (N, 1, H, W)

    background = uniform(count, 3, 1, 1)
    foreground = uniform(count, 3, 1, 1)
    # Keep the shape visible: push its colour at least 0.45 away (RGB distance) from the background.
    difference = foreground - background
    distance = difference.norm(dim=1, keepdim=True).clamp_min(1e-6)
    foreground = (background + difference * (0.45 / distance).clamp_min(1.0)).clamp(0, 1)
    # A smooth background gradient and pixel noise make raw pixels a poor feature.
    slope = uniform(count, 1, 1, 1, low=-0.5, high=0.5)
    along_x = (uniform(count, 1, 1, 1) < 0.5).float()
    position = grid / size - 0.5
    ramp = slope * (along_x * position[None, None, None, :] + (1 - along_x) * position[None, None, :, None])
    image = torch.where(mask, foreground, background + ramp)
    image = image + torch.randn(count, 3, size, size, generator=generator) * 0.08
    return (image.clamp(0, 1) * 255).round().to(torch.uint8), labels, _bounding_boxes(mask.squeeze(1))


def shapes(train_size: int = 50_000, test_size: int = 10_000, seed: int = 0) -> tuple[ImageDataset, ImageDataset]:
    """Synthetic shapes: 10 classes, 32×32 RGB, random position, size, colour and rotation.

    Deterministic for a seed and generated offline in a few seconds for 50,000 images.
    Returns (train, test), normalised with the training set's mean and std. Each image's shape has its box,
    `dataset.boxes` (N, 4) as (x1, y1, x2, y2) in pixels; `dataset.detection()` serves them to a detector.
    """
    if train_size <= 0 or test_size < 0:
        raise ValueError(f"train_size must be > 0 and test_size >= 0, got {train_size} and {test_size}.")
    parts = []
    for offset, count in ((0, train_size), (1, test_size)):
        generator = torch.Generator().manual_seed(seed * 2 + offset)
        chunks = [_render_shapes(min(4096, count - start), generator) for start in range(0, count, 4096)]
        images = torch.cat([c[0] for c in chunks]) if chunks else torch.empty(0, 3, 32, 32, dtype=torch.uint8)
        labels = torch.cat([c[1] for c in chunks]) if chunks else torch.empty(0, dtype=torch.long)
        boxes = torch.cat([c[2] for c in chunks]) if chunks else torch.empty(0, 4)
        parts.append((images, labels, boxes))
    train = ImageDataset(*parts[0][:2], SHAPE_CLASSES, boxes=parts[0][2])
    test = ImageDataset(*parts[1][:2], SHAPE_CLASSES, train.mean, train.std, boxes=parts[1][2])
    return train, test


# ---------------------------------------------------------------------------------------------
# CIFAR-10


def _cifar10_missing_message(root: Path, reason: str) -> str:
    return (
        f"CIFAR-10 is not in {root.resolve()} ({reason}). Download {CIFAR10_URL} on a machine with internet "
        f"access, put the file cifar-10-python.tar.gz in {root.resolve()} and run again (it is checked and "
        "unpacked there); or use the offline shapes dataset instead."
    )


def cifar10(
    root: str | Path = "data", download: bool = True, timeout: float = 30.0
) -> tuple[ImageDataset, ImageDataset]:
    """CIFAR-10 (50,000 train, 10,000 test images) through torchvision, kept in `root`.

    Downloads (about 170 MB) when the files are missing and `download` is true. Offline and
    without the files, raises FileNotFoundError saying where to put the archive.
    """
    from torchvision.datasets import CIFAR10

    root = Path(root)
    try:
        if download:
            root.mkdir(parents=True, exist_ok=True)
            previous = socket.getdefaulttimeout()  # urllib has no timeout by default: never hang
            socket.setdefaulttimeout(timeout)
            try:
                train = CIFAR10(str(root), train=True, download=True)
            finally:
                socket.setdefaulttimeout(previous)
        else:
            train = CIFAR10(str(root), train=True, download=False)
        test = CIFAR10(str(root), train=False, download=False)
    except (urllib.error.URLError, OSError) as error:
        raise FileNotFoundError(_cifar10_missing_message(root, f"download failed: {error}")) from error
    except RuntimeError as error:  # torchvision: "Dataset not found or corrupted. You can use download=True …"
        raise FileNotFoundError(_cifar10_missing_message(root, "files missing or corrupted")) from error

    def as_tensors(split):
        images = torch.from_numpy(split.data).permute(0, 3, 1, 2).contiguous()  # NHWC → NCHW, uint8
        return images, torch.as_tensor(split.targets, dtype=torch.long)

    train_set = ImageDataset(*as_tensors(train), CIFAR10_CLASSES)
    return train_set, ImageDataset(*as_tensors(test), CIFAR10_CLASSES, train_set.mean, train_set.std)
