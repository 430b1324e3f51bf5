"""Optimizer state sharded over ranks: ZeRO stage 1 (torch's ZeroRedundancyOptimizer) with DDP,
compared with plain DDP and with FSDP2, which shards parameters and gradients as well.

With plain DDP every rank keeps the whole optimizer state (AdamW: 2 × the parameters' bytes).
ZeroRedundancyOptimizer gives each rank the state of about 1/world_size of the parameters
(whole tensors, assigned greedily by size): each rank updates its part, then broadcasts it, so
every rank ends with the same parameters as plain DDP (Rajbhandari et al. 2020, "ZeRO").
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..optim import (
    NO_DECAY_BY_DEFAULT,
    check_lr,
    check_weight_decay,
    decay_groups,
    make_optimizer,
    optimizer_class_and_options,
)
from .parallel import data_parallel, rank, sharded_data_parallel, state_bytes, world_size

SHARDINGS = ("ddp", "ddp+zero", "fsdp2")


def zero_optimizer(
    model: nn.Module,
    optimizer: str = "adamw",
    *,
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    no_decay_1d: bool | None = None,
) -> torch.optim.Optimizer:
    """A ZeroRedundancyOptimizer over `model`'s parameters (a bare model or its DDP wrapper) for an
    optimizer name of gpukit.optim, with the same parameter groups as make_optimizer gives it.
    Call inside a distributed job (after gk.distributed.setup())."""
    if not dist.is_initialized():
        raise RuntimeError("zero_optimizer needs a process group: call gk.distributed.setup() first.")
    from torch.distributed.optim import ZeroRedundancyOptimizer

    check_lr(lr)
    check_weight_decay(weight_decay)
    optimizer_class, options = optimizer_class_and_options(optimizer)
    no_decay = optimizer in NO_DECAY_BY_DEFAULT if no_decay_1d is None else no_decay_1d
    groups = decay_groups(model.parameters(), weight_decay, no_decay)
    return ZeroRedundancyOptimizer(groups, optimizer_class=optimizer_class, lr=lr, **options)


def _flat_parameters(model: nn.Module) -> torch.Tensor:
    """Every parameter, whole (FSDP2's shards gathered), as one CPU float64 vector."""
    parts = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return torch.cat([part.reshape(-1).double().cpu() for part in parts])


def compare_sharding(
    build_model: Callable[[], nn.Module],
    batches: Sequence,
    *,
    optimizer: str = "adamw",
    lr: float = 1e-3,
    weight_decay: float = 0.0,
    shardings: Sequence[str] = SHARDINGS,
    loss_fn: Callable = nn.functional.cross_entropy,
) -> dict[str, dict]:
    """Inside a worker: train a fresh `build_model()` on `batches` ((inputs, target) pairs, the same
    list on every rank; each rank takes every world_size-th) under each sharding, and return per
    sharding this rank's bytes ({"parameters", "gradients", "optimizer", "total"}, as
    gk.distributed.state_bytes counts them, after the last step, gradients kept) and the final
    parameters (a CPU vector, whole). Seed before calling: every rank must build the same model.
    """
    unknown = set(shardings) - set(SHARDINGS)
    if unknown:
        raise ValueError(f"unknown shardings {sorted(unknown)}; use some of {SHARDINGS}.")
    mine = list(batches)[rank() :: world_size()]
    if not mine:
        raise ValueError(f"{len(batches)} batches for {world_size()} ranks: give every rank at least one.")
    results = {}
    for sharding in shardings:
        torch.manual_seed(0)
        model = build_model()
        if sharding == "fsdp2":
            trained = sharded_data_parallel(model)
            optimizer_object = make_optimizer(optimizer, model, lr, weight_decay)
        else:
            trained = data_parallel(model)
            optimizer_object = (
                zero_optimizer(model, optimizer, lr=lr, weight_decay=weight_decay)
                if sharding == "ddp+zero"
                else make_optimizer(optimizer, model, lr, weight_decay)
            )
        for inputs, target in mine:
            optimizer_object.zero_grad(set_to_none=True)
            loss_fn(trained(inputs), target).backward()
            optimizer_object.step()
        if sharding == "ddp+zero":
            sizes = state_bytes(model)
            sizes["optimizer"] = sum(
                v.nbytes
                for state in optimizer_object.optim.state.values()
                for v in state.values()
                if isinstance(v, torch.Tensor)
            )
            sizes["total"] = sizes["parameters"] + sizes["gradients"] + sizes["optimizer"]
        else:
            sizes = state_bytes(model, optimizer_object)
        results[sharding] = sizes | {"final_parameters": _flat_parameters(model)}
    return results
