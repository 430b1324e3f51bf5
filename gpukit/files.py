"""Writing files so that a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO


def _temporary(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def write_atomic(path: str | Path, write: bytes | Callable[[BinaryIO], None]) -> None:
    """Write `path` through a temporary file in the same folder, then rename it over `path`.

    `write` is the bytes, or a function that writes to the open file. A crash mid-write leaves
    the previous file intact: rename is atomic on POSIX and Windows. The folder is created.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temporary(path)
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


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Delete the temporary files that write_atomic left beside `path` in a process killed mid-write.

    Those of a process still running are kept (it may be writing now); on Windows, where a process cannot
    be probed safely, only this process's own. Returns the paths deleted.
    """
    path = Path(path)
    removed = []
    for temporary in path.parent.glob(f".{glob.escape(path.name)}.*.tmp"):
        pid = temporary.name[len(path.name) + 2 : -len(".tmp")]
        if pid.isdigit() and (int(pid) == os.getpid() or not _running(int(pid))):
            temporary.unlink(missing_ok=True)
            removed.append(temporary)
    return removed


def _running(pid: int) -> bool:
    if os.name != "posix":
        return True
    try:
        os.kill(pid, 0)  # signal 0: only asks whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def save_atomic(state, path: str | Path) -> None:
    """torch.save, atomically (see write_atomic)."""
    import torch

    write_atomic(path, lambda file: torch.save(state, file))
