"""Overlap the copy of the next batch to the GPU with the current training step.

`prefetch(loader, device)` yields each batch already on `device`, split into inputs and target
(gpukit.step.Batch). On a CUDA device the copy of batch k+1 is issued on a side stream when the
caller asks for it, right after launching its step on batch k, so it runs while that step computes;
from pinned host memory (`pin_memory=True`) the copy is truly asynchronous. Anywhere else it is a
pass-through: the loader's own batches, untouched.

Correctness, the two rules of side-stream copies:
- the compute stream waits for the side stream before it uses a batch (`wait_stream`);
- each copied tensor is marked as used by the compute stream (`record_stream`): its memory was
  allocated on the side stream, and without the mark the caching allocator could hand it out again
  while the step still reads it (a use-after-free that shows up as wrong numbers, not an error).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from ..step import Batch, split_batch, to_device

_DONE = object()


class CUDAPrefetcher:
    """Batches of `loader` on a CUDA `device`, each copied on a side stream one step ahead."""

    def __init__(self, loader: Iterable, device: torch.device):
        if device.type != "cuda":
            raise ValueError(
                f"CUDAPrefetcher copies to a CUDA device, got {device}; use prefetch(), which passes "
                "batches through unchanged elsewhere."
            )
        self.loader, self.device = loader, device
        self.stream = torch.cuda.Stream(device)

    def __len__(self) -> int:
        return len(self.loader)

    def _copy(self, raw) -> Batch | object:
        if raw is _DONE:
            return _DONE
        with torch.cuda.stream(self.stream):
            return to_device(split_batch(raw), self.device)  # a batch object by its own .to(device)

    def __iter__(self) -> Iterator[Batch]:
        iterator = iter(self.loader)
        upcoming = self._copy(next(iterator, _DONE))
        while upcoming is not _DONE:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_stream(self.stream)  # the copy must be complete before the step reads the batch
            batch = upcoming
            for tensor in batch.tensors():
                if tensor.is_cuda:
                    tensor.record_stream(compute)  # allocated on the side stream, used on this one
            yield batch
            # Back here once the caller has launched the step on `batch` (asynchronously): the next batch is
            # loaded now and its copy runs on the side stream while that step computes.
            upcoming = self._copy(next(iterator, _DONE))


def prefetch(loader: Iterable, device: str | torch.device) -> Iterable:
    """`loader` with each batch copied to a CUDA device one step ahead on a side stream; elsewhere `loader` itself."""
    device = torch.device(device)
    return CUDAPrefetcher(loader, device) if device.type == "cuda" else loader
