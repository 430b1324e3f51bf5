"""Writing files so that a crash or a full disk never leaves half a file behind."""

from __future__ import annotations

import glob
import os
import socket
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

try:
    import fcntl  # POSIX: lock_folder
except ImportError:  # Windows
    fcntl = None


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


def writable_folder(path: str | Path, name: str, purpose: str) -> Path:
    """`path` as a Path once it is a folder this process can create files in (made now if missing); else a ValueError
    that names the argument (`name`), what is in the way, and what to do. `purpose` says what the folder is for.
    mkdir and open alone say only "File exists", "Not a directory" or "No such file or directory" for these."""
    folder = Path(path)
    instead = f"pass a folder path ({purpose})"
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"{name} {str(folder)!r} is a file, not a folder; {instead}.")
    blocking = next((part for part in reversed(folder.parents) if part.exists() and not part.is_dir()), None)
    if blocking is not None:
        raise ValueError(f"{name} {str(folder)!r} cannot be made: {str(blocking)!r} in its path is a file; {instead}.")
    if folder.resolve().parts[1:2] in (("proc",), ("sys",)):
        raise ValueError(
            f"{name} {str(folder)!r} lies in /{folder.resolve().parts[1]}, the kernel's view of processes and devices, "
            f"where no files can be written; pass a folder on a disk ({purpose})."
        )
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):  # what copying or saving into it needs: a new file
            pass
    except OSError as error:
        raise ValueError(
            f"{name} {str(folder)!r} cannot be written: {error.strerror or error}; pass a folder you can write to "
            f"({purpose})."
        ) from error
    return folder


def save_atomic(state, path: str | Path) -> None:
    """torch.save, atomically (see write_atomic)."""
    import torch

    write_atomic(path, lambda file: torch.save(state, file))


class FolderInUseError(RuntimeError):
    """Another running process holds the folder (fit's checkpoint_dir): two runs would overwrite each other."""


def lock_folder(folder: str | Path, what: str = "folder") -> Callable[[], None] | None:
    """Hold `folder` for this process: an exclusive lock on `folder/.gpukit.lock` (fcntl.flock), or FolderInUseError
    naming the process that holds it. Returns the function that lets it go.

    The operating system drops the lock when its process ends however it ends (SIGKILL, a crash, a closed notebook), so
    a run that died never blocks the next one; the file itself stays (deleting it while another process waits on it
    would let two hold it). Without fcntl (Windows) nothing is locked and None is returned.
    """
    if fcntl is None:  # Windows: no flock; two runs in one folder are not detected there
        return None
    path = Path(folder) / ".gpukit.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    file = open(path, "a+")
    try:
        fcntl.flock(file.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        owner = file.read().strip() or "another process"
        file.close()
        raise FolderInUseError(
            f"{what} {folder} is in use by a run still going ({owner}): two runs in one folder overwrite each other's "
            f"saves. Wait for it to finish (or stop it), or pass another {what} to this run."
        ) from None
    file.seek(0)
    file.truncate()
    file.write(f"process {os.getpid()} on {socket.gethostname()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}")
    file.flush()

    def release() -> None:
        fcntl.flock(file.fileno(), fcntl.LOCK_UN)
        file.close()

    return release
