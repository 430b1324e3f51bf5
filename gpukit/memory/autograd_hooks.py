"""The bytes autograd saves for backward, counted with PyTorch's own hooks on a real run.

saved_bytes()  one real forward pass and loss on the device; torch.autograd.graph.saved_tensors_hooks sees
               every tensor autograd keeps for backward: each storage counted once, whole, parameters and
               buffers left out.

A check on the rest of gk.memory, so it shares none of their counting: estimate() predicts with fake
tensors and breakdown() measures with the trackers of counting.py; this runs the model for real and counts
in its own few lines. Where all three agree, they do not share one mistake. Lessons 03 and 06 use it so.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import torch
from torch import nn

from ..env import resolve_device
from ..step import Loss, split_batch
from .counting import keeps_generators

__all__ = ["saved_bytes"]


@keeps_generators
def saved_bytes(
    model: nn.Module,
    batch,
    loss_fn: str | Callable | None = None,
    *,
    device: str | torch.device | None = None,
) -> int:
    """Bytes autograd saves for backward in one forward pass and loss of `model` on `batch`, on `device`.

    A real run, in fp32, of a copy of the model in training mode (yours is not changed). Every tensor
    autograd saves passes a saved_tensors_hooks pack hook; the storage it lives in is counted once, whole,
    unless it holds a parameter or a buffer (weights, not activations). `batch` is any form fit accepts,
    (inputs, target) above all; each of its tensors is copied to `device` into storage of its own, as a
    loader's batch is. The loss is fit's for `loss_fn` (default: cross-entropy for integer targets).
    Tensors saved inside a region with activation checkpointing are hidden from these hooks, so a
    checkpointed model shows only what its regions keep at their borders.

        gk.memory.saved_bytes(model, (images, labels), device="cuda")  # bytes, an int
    """
    device = resolve_device(device)
    copied = copy.deepcopy(model).to(device).train()
    batch = split_batch(batch).map(lambda tensor: tensor.to(device).clone())
    resident = {tensor.untyped_storage().data_ptr() for tensor in (*copied.parameters(), *copied.buffers())}
    saved = {}  # storage address → its bytes

    def count(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in resident:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(count, lambda tensor: tensor):
        loss = Loss(loss_fn)(batch.call(copied), batch.target)
    del loss  # the graph held every saved tensor, so no address was reused for another before the count ended
    return sum(saved.values())
