"""Model parallelism in its simplest form: a model split in two stages on two ranks (a pipeline).

Rank 0 holds the first layers, rank 1 the rest. A batch is cut into micro-batches; rank 0 sends
each micro-batch's activations to rank 1 as soon as it has them, so both ranks work at the same
time on different micro-batches (GPipe's schedule: all forwards, then all backwards).
Rank 1 computes the loss and sends the gradient of each activation back (float32 activations). Each rank holds and
updates only its own stage's parameters: that is the point, a model too big for one device.

The device is whatever `gk.distributed.setup()` chose for the rank, never a hard-coded `cuda:1`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from ..models import FastCNN

_HEADER = 8  # int64 slots that carry an activation's shape from stage 0 to stage 1


class Scale(nn.Module):
    """Multiplies by a constant: FastCNN's logit scale as a layer, so that a split keeps it."""

    def __init__(self, factor: float):
        super().__init__()
        self.factor = factor

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


def split_in_two(model: nn.Sequential) -> tuple[nn.Sequential, nn.Sequential]:
    """Cut an nn.Sequential into two stages with about the same number of parameters each.

    The stages share their layers (and parameters) with `model`.
    """
    if not isinstance(model, nn.Sequential):
        raise TypeError(f"split_in_two takes an nn.Sequential, got {type(model).__name__}; list its layers in one.")
    if type(model).forward is not nn.Sequential.forward and not isinstance(model, FastCNN):
        raise ValueError(
            f"{type(model).__name__} changes nn.Sequential's forward, so its layers alone do not compute the same "
            "function; build a plain nn.Sequential of the layers."
        )
    layers = list(model.children())
    if isinstance(model, FastCNN):
        layers.append(Scale(model.logit_scale))  # FastCNN multiplies the logits in forward
    if len(layers) < 2:
        raise ValueError("a model with fewer than two layers cannot be split into two stages.")
    counts = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total, before, best, cut = sum(counts), 0, None, 1
    for index in range(1, len(layers)):
        before += counts[index - 1]
        imbalance = abs(2 * before - total)
        if best is None or imbalance < best:
            best, cut = imbalance, index
    return nn.Sequential(*layers[:cut]), nn.Sequential(*layers[cut:])


class TwoStagePipeline:
    """This rank's stage of a model split over ranks 0 and 1 (other ranks take no part).

    Call `step(images, labels)` on both ranks with the same batch: it runs forward and backward
    through both stages in `micro_batches` pieces and leaves each rank's gradients in its stage.
    It returns the mean loss on rank 1 and None on rank 0. BatchNorm sees each micro-batch on its
    own, exactly as with gradient accumulation over the same micro-batches on one device.
    """

    def __init__(self, model: nn.Sequential, *, micro_batches: int = 4, device: torch.device | str | None = None):
        if not dist.is_initialized() or dist.get_world_size() < 2:
            raise RuntimeError("a two-stage pipeline needs 2 ranks: start it with gk.distributed.launch(fn, 2).")
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}.")
        self.rank = dist.get_rank()
        if self.rank > 1:
            raise RuntimeError(f"rank {self.rank} has no stage: the pipeline uses ranks 0 and 1.")
        first, second = split_in_two(model)
        self.split = len(first)  # layers of `model` (and Scale) on stage 0
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.stage = (first if self.rank == 0 else second).to(self.device)
        self.micro_batches = micro_batches

    def parameters(self):
        return self.stage.parameters()

    def step(self, images: torch.Tensor, labels: torch.Tensor, loss_fn=nn.functional.cross_entropy):
        if self.rank == 0:
            return self._first_stage(images.to(self.device))
        return self._last_stage(labels.to(self.device), loss_fn)

    def _first_stage(self, images: torch.Tensor) -> None:
        outputs, pending = [], []  # pending: (request, tensor), the tensor alive until it is sent
        for chunk in images.chunk(self.micro_batches):
            output = self.stage(chunk)
            header = torch.zeros(_HEADER, dtype=torch.int64, device=self.device)
            header[: output.dim()] = torch.tensor(output.shape)
            sent = output.detach().contiguous()
            # isend: stage 0 goes on with the next micro-batch while this one travels.
            pending += [(dist.isend(header, dst=1), header), (dist.isend(sent, dst=1), sent)]
            outputs.append(output)
        for output in outputs:  # gradients come back in the order the activations went
            gradient = torch.empty_like(output)
            dist.recv(gradient, src=1)
            output.backward(gradient)
        for request, _ in pending:
            request.wait()

    def _last_stage(self, labels: torch.Tensor, loss_fn) -> torch.Tensor:
        # All forwards, then all backwards, in the order stage 0 sends and receives: NCCL runs the
        # sends and receives between two ranks in one queue, so any other order could deadlock.
        inputs, losses = [], []
        for chunk_labels in labels.chunk(self.micro_batches):
            header = torch.empty(_HEADER, dtype=torch.int64, device=self.device)
            dist.recv(header, src=0)
            activations = torch.empty([int(size) for size in header.tolist() if size > 0], device=self.device)
            dist.recv(activations, src=0)
            activations.requires_grad_(True)
            inputs.append(activations)
            losses.append(loss_fn(self.stage(activations).float(), chunk_labels) / self.micro_batches)
        pending = []
        for activations, loss in zip(inputs, losses):
            loss.backward()
            gradient = activations.grad.contiguous()  # kept in `pending`: it must live until it is sent
            pending.append((dist.isend(gradient, dst=0), gradient))
        for request, _ in pending:
            request.wait()
        return sum(loss.detach() for loss in losses)
