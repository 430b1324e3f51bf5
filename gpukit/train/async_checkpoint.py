"""Saving training state without stopping training for the disk: `fit(checkpoint_dir=..., save_in_background=True)`.

A synchronous save blocks training for the whole write: serialising, hashing and fsync-ing the file (a
100 MB state: a fraction of a second to seconds, on a network disk more). A background save blocks it only
while the state is copied to host memory (a snapshot: the next optimizer step changes the weights in
place), then a thread writes the snapshot exactly as the synchronous save does: to a temporary file,
fsync-ed, renamed over the last one. A crash mid-write therefore leaves the previous complete file, never
half a file. At most one write is in flight: a save waits for the previous one first, and fit waits for
the last before it returns. An error in the thread is raised in training at the next save or at the end.
torch.distributed.checkpoint.async_save does the same for sharded state (FSDP2), written as a folder.
"""

from __future__ import annotations

import copy
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from .checkpoint_file import write_checkpoint

__all__ = ["BackgroundWriter", "snapshot"]


def snapshot(state):
    """A copy of `state` that training cannot change: every tensor copied to host memory (tensors that share
    a storage, such as tied weights, still share one), every other value deep-copied (a History's lists grow
    as training goes on)."""
    copies: dict[int, torch.UntypedStorage] = {}  # a storage's address -> its copy

    def copied(leaf):
        if not isinstance(leaf, torch.Tensor):
            return copy.deepcopy(leaf)
        storage = leaf.untyped_storage()
        if storage.data_ptr() not in copies:
            copies[storage.data_ptr()] = _copy_storage(storage)
        return torch.empty(0, dtype=leaf.dtype).set_(
            copies[storage.data_ptr()], leaf.storage_offset(), leaf.size(), leaf.stride()
        )

    return tree_map(copied, state)


def _copy_storage(storage: torch.UntypedStorage) -> torch.UntypedStorage:
    """The bytes of `storage` in host memory. A CPU storage is copied by NumPy, in one thread: torch's copy
    runs an OpenMP parallel region per tensor, which waited ~10 ms each (13x slower) on a busy 2-core machine."""
    if storage.device.type != "cpu":
        return storage.cpu()
    as_bytes = torch.empty(0, dtype=torch.uint8).set_(storage)
    return torch.from_numpy(as_bytes.numpy().copy()).untyped_storage()


class BackgroundWriter:
    """Writes states with `write(state, path)` (default: gpukit's checkpoint file, atomically) in a thread.

    save() returns once the state is copied; `blocked` lists the seconds each save held the caller.
    """

    def __init__(self, write: Callable = write_checkpoint):
        self.write = write
        self.thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.blocked: list[float] = []

    def save(self, state, path: str | Path) -> None:
        started = time.perf_counter()
        self.wait()  # one write at a time: two would race to rename over the same file
        copied = snapshot(state)
        self.thread = threading.Thread(target=self._write, args=(copied, Path(path)), daemon=False)
        self.thread.start()
        self.blocked.append(time.perf_counter() - started)

    def _write(self, state, path: Path) -> None:
        try:
            self.write(state, path)
        except BaseException as error:  # raised in the training thread by wait()
            self.error = error

    def wait(self) -> None:
        """Block until the write in flight is on disk; raise its error, if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise RuntimeError(
                f"a checkpoint written in the background failed ({type(error).__name__}: {error}); the last complete "
                "file is still in place. Fix the cause (disk space, permissions) and train again to resume from it."
            ) from error
