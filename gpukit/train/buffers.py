"""A model's buffers kept and put back: what a forward moves (BatchNorm's running statistics in training, a
fake-quant observer's ranges in any mode) that fit's checks, or a refused first batch, must not leave behind."""

from __future__ import annotations

import contextlib

import torch
from torch import nn


def kept_buffers(model: nn.Module) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each buffer of the model with a copy of its value, for `put_back`: what a forward moves that a check, or a
    refused first batch, must not leave behind (BatchNorm's statistics in training; a fake-quant observer's ranges,
    which move in eval mode too). A lazy module's buffers, not yet made, have nothing to keep."""
    return [(buffer, buffer.detach().clone()) for buffer in model.buffers() if not nn.parameter.is_lazy(buffer)]


def put_back(kept: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """The buffers as `kept_buffers` copied them, exactly: also one that a forward resized (QAT's observers grow from
    shape (0,) to one value per channel at their first forward), back to its shape."""
    with torch.no_grad():
        for buffer, value in kept:
            if buffer.shape != value.shape:
                buffer.resize_(value.shape)
            buffer.copy_(value)


@contextlib.contextmanager
def buffers_kept(model: nn.Module):
    """The model's buffers put back as they were when the block ends, however it ends."""
    kept = kept_buffers(model)
    try:
        yield
    finally:
        put_back(kept)
