"""Writing files so that a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def write_atomic(path: str | Path, write: bytes | Callable[[BinaryIO], None]) -> None:
    """Write `path` through a temporary file in the same folder, then rename it over `path`.

    `write` is the bytes, or a function that writes to the open file. A crash mid-write leaves
    the previous file intact: rename is atomic on POSIX and Windows. The folder is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(temporary, "wb") as file:
            if callable(write):
                write(file)
            else:
                file.write(write)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temporary, path)
    finally:
        temporary.unlink(missing_ok=True)


def save_atomic(state, path: str | Path) -> None:
    """torch.save, atomically (see write_atomic)."""
    import torch

    write_atomic(path, lambda file: torch.save(state, file))
