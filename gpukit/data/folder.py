"""Your own images: `image_folder()` reads JPEG/PNG files in class folders into one uint8 tensor.

The layout is torchvision's ImageFolder: root/<class name>/<image files>. Every image becomes RGB uint8
`size`×`size` (shorter side resized with antialiasing, then centre-cropped) in an ImageDataset, so the fast
device-resident loaders work on it as on CIFAR-10. Decoding thousands of files takes seconds; reading one
tensor takes milliseconds: the result is cached beside the data in a hidden file, and rebuilt when any
image file is added, removed or changed.
"""

from __future__ import annotations

import errno
import hashlib
import os
import warnings
from functools import partial
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..files import save_atomic
from ..validation import check_int
from . import vision
from .images import ImageDataset

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png")  # compared in lower case: .JPG and .Png count too
CACHE_VERSION = 1  # part of the fingerprint: bump it when decoding changes, and old caches are rebuilt
_SHOWN_NAMES = 10  # at most this many file names in a warning or error; the rest are counted


def image_folder(
    root: str | os.PathLike, size: int = 32, *, cache: bool = True, skip_corrupt: bool = True, progress: bool = True
) -> ImageDataset:
    """Images in root/<class name>/<file>.jpg|.jpeg|.png as an ImageDataset of RGB uint8 (N, 3, size, size).

    Classes are the subfolder names, sorted; an image's label is its class's index in that order.
    Files in nested folders of a class count for that class. Hidden files and folders (".DS_Store",
    ".ipynb_checkpoints") are ignored silently, other files with a warning.
    Every image is decoded to RGB (grey, palette and RGBA images too; EXIF rotation applied), its shorter
    side resized to `size` pixels with antialiasing, then centre-cropped to `size`×`size`.

    cache: keep the decoded tensor in root/.gpukit-cache-{size}px.pt and use it while no image file was
        added, removed or changed (paths, byte sizes and modification times are compared). An unreadable
        cache is rebuilt; one that cannot be written (read-only folder) is skipped, each with a warning.
    skip_corrupt: files that cannot be decoded are left out with a warning that names them; with False,
        such a file raises ValueError instead.
    progress: show a progress bar while decoding.
    """
    check_int("size", size, note="(pixels per side of the square images)")
    root = Path(root).expanduser()
    classes, paths, labels = _scan(root)
    fingerprint = _fingerprint(root, paths, size)
    cache_path = root / f".gpukit-cache-{size}px.pt"

    state = _read_cache(cache_path, fingerprint, size, len(paths)) if cache else None
    if state is None:
        images, skipped = _decode_all(root, paths, size, progress)
    else:
        images, skipped = state["images"], state["skipped"]

    if skipped and not skip_corrupt:
        raise ValueError(
            f"{_names(skipped, root)} could not be decoded (corrupt, truncated or not really JPEG/PNG). "
            "Delete or replace the file(s), or pass skip_corrupt=True to leave such files out with a warning."
        )
    if skipped:
        warnings.warn(
            f"Skipped {len(skipped)} of {len(paths)} files that could not be decoded (corrupt, truncated or not "
            f"really JPEG/PNG): {_names(skipped, root)}. Delete or replace them to silence this warning.",
            stacklevel=2,
        )
    labels = labels[_kept_mask(paths, skipped)]
    counts = torch.bincount(labels, minlength=len(classes))
    for name, count in zip(classes, counts.tolist()):
        if count == 0:  # every image file of this class was corrupt
            raise ValueError(_no_images_message(root, name, "all its image files could not be decoded"))

    if state is not None:  # mean and std as ImageDataset computed them from these images when caching
        return ImageDataset(images, labels, classes, state["mean"], state["std"])
    dataset = ImageDataset(images, labels, classes)
    if cache:
        state = dict(fingerprint=fingerprint, images=images, skipped=skipped, mean=dataset.mean, std=dataset.std)
        _write_cache(cache_path, state)
    return dataset


# ---------------------------------------------------------------------------------------------
# Finding the files


def _scan(root: Path) -> tuple[list[str], list[str], torch.Tensor]:
    """(class names sorted, image paths relative to root in posix form, labels int64 (N,)), by class then path."""
    if not root.exists():
        raise FileNotFoundError(
            f"Image folder {root} does not exist. Pass the folder that holds one subfolder per class "
            "(root/<class name>/<image files>)."
        )
    if not root.is_dir():
        raise NotADirectoryError(f"{root} is a file; pass the folder that holds one subfolder per class.")
    entries = sorted(os.scandir(root), key=lambda entry: entry.name)
    folders = {entry.name: _is_folder(entry, root) for entry in entries}
    classes = [name for name, is_folder in folders.items() if is_folder and not _hidden(name)]
    ignored = [name for name, is_folder in folders.items() if not is_folder and not _hidden(name)]
    if not classes:
        raise ValueError(
            f"{root} has no class subfolders. image_folder expects root/<class name>/<image files>, for example "
            f"{root / 'cat' / '1.jpg'} and {root / 'dog' / '2.jpg'}: put each class's images in a folder named "
            "after the class."
        )

    paths, labels = [], []
    for label, name in enumerate(classes):
        _check_not_above(root, name)
        found = []
        for folder, folders, files in os.walk(root / name, onerror=partial(_raise_unreadable, root)):
            folders[:] = [f for f in folders if not _hidden(f)]  # prune .ipynb_checkpoints and the like
            relative = Path(folder).relative_to(root).as_posix()
            for file in files:
                if _hidden(file):
                    continue
                is_image = os.path.splitext(file)[1].lower() in IMAGE_EXTENSIONS
                (found if is_image else ignored).append(f"{relative}/{file}")
        if not found:
            raise ValueError(_no_images_message(root, name, "it holds no image files"))
        found.sort()
        paths += found
        labels += [label] * len(found)

    if ignored:
        warnings.warn(
            f"Ignored {len(ignored)} file(s) in {root} that are not images in a class folder (extensions "
            f"{', '.join(IMAGE_EXTENSIONS)}): {_names(sorted(ignored), root, 3)}.",
            stacklevel=3,
        )
    return classes, paths, torch.tensor(labels, dtype=torch.long)


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _is_folder(entry: os.DirEntry, root: Path) -> bool:
    try:
        return entry.is_dir()  # follows a symbolic link: a link loop raises here
    except OSError as error:
        _raise_unreadable(root, error)


def _raise_unreadable(root: Path, error: OSError) -> None:
    """An OSError of the same kind that names the file or folder that cannot be read, why, and what to do."""
    path = error.filename or "a file"
    link = "point the link at a real image file or folder, or delete it"
    why, fix = {
        errno.ELOOP: ("it is a symbolic link in a loop (it points to itself, or to a link that points back)", link),
        errno.ENOENT: ("it is a broken symbolic link (what it points to is gone)", link),
        errno.EACCES: ("permission denied", "make it readable (chmod a+r), or move it out of the folder"),
    }.get(error.errno, (error.strerror or str(error), "fix it, or move it out of the folder"))
    raise type(error)(error.errno, f"image_folder cannot read {path}: {why}. To load {root}, {fix}.") from error


def _check_not_above(root: Path, name: str) -> None:
    """A class folder that is a link to root or to a folder above it would hold every class's images, again."""
    target = (root / name).resolve()
    if root.resolve().is_relative_to(target):
        raise ValueError(
            f"Class folder {root / name} is a symbolic link to {target}, which holds {root} itself, so it would hold "
            f"every other class's images too; delete the link, or point it at a folder of its own class's images."
        )


def _fingerprint(root: Path, paths: list[str], size: int) -> str:
    """A digest of what the decoded tensor depends on: the files (path, bytes, mtime in ns), size, format."""
    digest = hashlib.sha256(f"gpukit image_folder v{CACHE_VERSION} size={size}\n".encode())
    folder = os.fspath(root)
    for path in paths:
        try:
            stat = os.stat(os.path.join(folder, path))  # strings, not Path objects: half the time for 4,000 files
        except OSError as error:  # a broken link, a link loop
            _raise_unreadable(root, error)
        digest.update(f"{path}\t{stat.st_size}\t{stat.st_mtime_ns}\n".encode())
    return digest.hexdigest()


# ---------------------------------------------------------------------------------------------
# Decoding


def _decode(path: Path, size: int) -> torch.Tensor:
    """One JPEG or PNG file as RGB uint8 (3, size, size). RuntimeError where the bytes cannot be decoded."""
    data = path.read_bytes()  # an OSError (unreadable file) propagates: that is not a corrupt image
    if not data:
        raise RuntimeError(f"{path} is empty")
    io, F = vision.io(), vision.v2().functional
    image = io.decode_image(
        torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=io.ImageReadMode.RGB, apply_exif_orientation=True
    )
    image = F.to_dtype(image, torch.uint8, scale=True)  # 16-bit PNGs decode to uint16
    image = F.resize(image, [size], antialias=True)  # shorter side → size pixels
    return F.center_crop(image, [size, size])


def _decode_all(root: Path, paths: list[str], size: int, progress: bool) -> tuple[torch.Tensor, list[str]]:
    """(images uint8 (N, 3, size, size) of the decodable files, in order; relative paths that failed)."""
    # One thread: on the 2-core machine this was measured on, a pool of 2 threads decoded no faster (they did
    # run in parallel, but each image took about 1.5× the CPU time).
    images = torch.empty(len(paths), 3, size, size, dtype=torch.uint8)
    skipped, kept = [], 0
    for path in tqdm(paths, desc="Decoding images", unit="img", disable=not progress):
        try:
            images[kept] = _decode(root / path, size)
        except RuntimeError:  # what torchvision's decoders raise for bytes they cannot decode
            skipped.append(path)
            continue
        except OSError as error:  # a file that cannot be read (permissions, a disk error): not a corrupt image
            _raise_unreadable(root, error)
        kept += 1
    # A slice would keep (and torch.save would write) the whole allocation: copy when files were skipped.
    return (images[:kept].clone() if skipped else images), skipped


def _kept_mask(paths: list[str], skipped: list[str]) -> torch.Tensor:
    skipped = set(skipped)
    return torch.tensor([path not in skipped for path in paths], dtype=torch.bool)


# ---------------------------------------------------------------------------------------------
# The cache


def _read_cache(path: Path, fingerprint: str, size: int, file_count: int) -> dict | None:
    """The cached {"fingerprint", "images", "skipped", "mean", "std"} if it matches `fingerprint`, else None."""
    if not path.exists():
        return None
    try:
        state = torch.load(path, weights_only=True)  # tensors, strings and lists only: never runs code
    # A damaged file can make the (weights-only, code-free) unpickler fail in any way: IndexError, KeyError…
    except Exception as error:
        reason = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else 'empty'}"
        warnings.warn(f"The image cache {path} cannot be read ({reason}); decoding the images again.", stacklevel=3)
        return None
    if not isinstance(state, dict) or state.get("fingerprint") != fingerprint:
        return None  # files added, removed or changed since it was written: decode again
    images, skipped = state.get("images"), state.get("skipped")
    if (
        not isinstance(images, torch.Tensor)
        or images.dtype != torch.uint8
        or images.shape[1:] != (3, size, size)
        or not isinstance(skipped, list)
        or len(images) != file_count - len(skipped)
        or not all(isinstance(state.get(key), torch.Tensor) and state[key].shape == (3,) for key in ("mean", "std"))
    ):
        warnings.warn(f"The image cache {path} holds unexpected contents; decoding the images again.", stacklevel=3)
        return None
    return state


def _write_cache(path: Path, state: dict) -> None:
    try:
        save_atomic(state, path)  # through a temporary file: a crash never leaves half a cache
    except OSError as error:
        warnings.warn(
            f"Could not write the image cache {path} ({error}), so the next call decodes the images again. "
            "Make the folder writable, or pass cache=False to silence this warning.",
            stacklevel=3,
        )


# ---------------------------------------------------------------------------------------------
# Messages


def _names(paths: list[str], root: Path, shown: int = _SHOWN_NAMES) -> str:
    """Up to `shown` paths under root, then how many more."""
    names = ", ".join(str(root / path) for path in paths[:shown])
    return names + (f" and {len(paths) - shown} more" if len(paths) > shown else "")


def _no_images_message(root: Path, name: str, reason: str) -> str:
    return (
        f"Class folder {root / name} has no usable images ({reason}); image files must end in "
        f"{', '.join(IMAGE_EXTENSIONS)} (any case). Add images to it, or move the folder out of {root}."
    )
