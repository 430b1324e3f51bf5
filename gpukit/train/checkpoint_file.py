"""The checkpoint's file (`last.pt`): the bytes of torch.save, then one line with their SHA-256 and length, checked
before torch.load reads them: a damaged or truncated file is a CheckpointError naming it, never garbage weights.
torch.load reads the file as it is, so the weights stay readable without gpukit. Written atomically (files.py): a save
killed mid-write leaves the last complete file.
"""

from __future__ import annotations

import hashlib
import io
import pickle
import re
from pathlib import Path

import torch

from ..files import remove_stale_temporaries, write_atomic

FORMAT = 2  # 1: gpukit's earlier files (torch.save's bytes alone: no checksum, data order or generators)


class CheckpointError(RuntimeError):
    """A checkpoint cannot be resumed (damaged, truncated, or not the run this call describes), or cannot be saved
    (a full or read-only disk): the message names the cause, what to do, and the save kept."""


def _trailer(digest: bytes, size: int) -> bytes:
    return b"\ngpukit-checkpoint %d sha256=%s bytes=%016d\n" % (FORMAT, digest.hex().encode(), size)


_TRAILER = re.compile(rb"\ngpukit-checkpoint (\d+) sha256=([0-9a-f]{64}) bytes=(\d{16})\n\Z")
_TRAILER_LENGTH = len(_trailer(bytes(32), 0))
_END_OF_ZIP = b"PK\x05\x06"  # how the bytes of torch.save end (the zip's last record, 22 bytes, no comment)


class _Hashing:
    """A write-only file that hashes and counts what passes through it (torch.save needs write and flush)."""

    def __init__(self, file):
        self.file, self.sha256, self.size = file, hashlib.sha256(), 0
        self.error: OSError | None = None  # a failed write (a full disk), which torch may re-raise as a RuntimeError

    def write(self, data) -> int:
        self.sha256.update(data)
        self.size += len(data)
        try:
            return self.file.write(data)
        except OSError as error:
            self.error = error
            raise

    def flush(self) -> None:
        self.file.flush()


def write_checkpoint(state: dict, path: Path) -> None:
    """torch.save `state` to `path`, then a line with the SHA-256 and length of its bytes; atomically.

    torch.load reads such a file as it is (a zip archive may be followed by other bytes), so the weights
    stay readable without gpukit; read_checkpoint checks the line first.
    """

    def write(file) -> None:
        hashing = _Hashing(file)
        try:
            torch.save(state, hashing)
        except RuntimeError as error:
            if isinstance(error.__context__, KeyboardInterrupt):  # Ctrl-C while torch's C++ writer called write()
                raise error.__context__ from None  # as Ctrl-C, not torch's "unexpected pos" RuntimeError
            if hashing.error is None:
                raise
            raise hashing.error from None  # the disk's own error (ENOSPC, EROFS), not torch's "unexpected pos"
        file.write(_trailer(hashing.sha256.digest(), hashing.size))

    remove_stale_temporaries(path)
    write_atomic(path, write)


def read_checkpoint(path: Path) -> dict:
    """The state in `path`, its checksum verified first; any fault is a CheckpointError that names the file."""
    remove_stale_temporaries(path)  # a save killed mid-write left them; they are never read
    where = f"cannot resume from {path}"
    if Path(path).is_dir():
        raise CheckpointError(
            f"{where}: it is a folder, where gpukit saves the run as a file of that name; move or rename the folder "
            "(gpukit never deletes it), or pass another checkpoint_dir."
        )
    try:
        data = Path(path).read_bytes()
    except OSError as error:
        raise CheckpointError(f"{where}: {error}.") from error
    afresh = "delete it (or pass a new checkpoint_dir) to start afresh, or restore it from a copy"
    if not data:
        raise CheckpointError(
            f"{where}: it is empty (0 bytes): something other than gpukit's saves, which never leave a partial file, "
            f"cut it short (a copy, a full disk); {afresh}."
        )
    match = _TRAILER.search(data, max(0, len(data) - _TRAILER_LENGTH - 8))  # (a format number of up to 9 digits)
    if match is None and data[-22:].startswith(_END_OF_ZIP):
        raise CheckpointError(
            f"{where}: it was written by an earlier gpukit, without a checksum or the data's order, and cannot be "
            "resumed exactly (torch.load still reads its weights); delete it or pass a new checkpoint_dir."
        )
    if match is None:
        raise CheckpointError(
            f"{where}: it is truncated, or no gpukit checkpoint: its {len(data):,} bytes do not end with the "
            f"checksum line gpukit writes last; {afresh}."
        )
    size, payload = int(match[3]), memoryview(data)[: match.start()]
    if int(match[1]) > FORMAT:
        raise CheckpointError(
            f"{where}: a newer gpukit wrote it (checkpoint format {int(match[1])}; this gpukit reads up to {FORMAT}). "
            "Upgrade gpukit to the version that wrote it (or a later one) to resume it, or pass a new checkpoint_dir "
            "to start afresh and keep this file as it is."
        )
    if int(match[1]) != FORMAT:
        raise CheckpointError(f"{where}: it is in format {int(match[1])}, this gpukit reads {FORMAT}; {afresh}.")
    if size != len(payload) or hashlib.sha256(payload).hexdigest() != match[2].decode():
        raise CheckpointError(
            f"{where}: it is damaged: its bytes no longer match the SHA-256 and length saved with them (the disk or "
            f"a copy changed them); {afresh}."
        )
    try:
        return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)  # it reads up to the line
    except (RuntimeError, pickle.UnpicklingError, EOFError, OSError) as error:
        raise CheckpointError(f"{where}: it is intact but torch.load cannot read it ({error}); {afresh}.") from error
