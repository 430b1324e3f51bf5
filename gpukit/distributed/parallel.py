"""Training on several processes: data parallelism (DDP), sharded data, and sharded data parallelism (FSDP2).
Setup inside a worker and the collectives for metrics are process_group.py's (re-exported here). See the package
docstring for the whole story."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from ..data.loaders import loader_for
from ..memory.blocks import find_blocks
from .process_group import (
    DEFAULT_TIMEOUT_SECONDS,
    Worker,
    barrier,
    check_same,
    cleanup,
    default_device,
    is_main,
    mean_over_ranks,
    names_over_ranks,
    objects_over_ranks,
    print0,
    rank,
    setup,
    sum_over_ranks,
    world_size,
)

__all__ = [
    "COMPRESSIONS",
    "DEFAULT_TIMEOUT_SECONDS",
    "Worker",
    "average_parameters",
    "barrier",
    "broadcast_buffers",
    "check_same",
    "check_same_batches",
    "cleanup",
    "data_parallel",
    "default_device",
    "is_main",
    "is_sharded",
    "mean_over_ranks",
    "names_over_ranks",
    "no_sync",
    "objects_over_ranks",
    "prepare",
    "print0",
    "rank",
    "setup",
    "shard",
    "sharded_data_parallel",
    "sharded_loader",
    "state_bytes",
    "sum_over_ranks",
    "world_size",
]

COMPRESSIONS = ("fp16", "bf16")  # DDP gradient compression hooks: all-reduce half the bytes


# ---------------------------------------------------------------------------------------------
# Data parallelism


def data_parallel(
    model: nn.Module,
    *,
    sync_batchnorm: bool = False,
    bucket_cap_mb: float = 25.0,
    compression: str | None = None,
    process_group: dist.ProcessGroup | None = None,
) -> DistributedDataParallel:
    """Wrap a model (already on its device) in DistributedDataParallel.

    DDP starts by copying rank 0's parameters and buffers to every rank, and during backward
    all-reduces the gradients in buckets of about `bucket_cap_mb` MiB, each as soon as its
    gradients are ready, so communication overlaps the rest of the backward pass. The
    gradients every rank ends with are the mean over ranks.

    sync_batchnorm: BatchNorm statistics over the global batch instead of each rank's part
                    (PyTorch runs SyncBatchNorm on GPUs only).
    compression:    "fp16" or "bf16": all-reduce gradients in half precision (half the bytes on the
                    wire, a little rounding); None sends float32.
    """
    if not dist.is_initialized():
        raise RuntimeError("data_parallel needs a process group: call gk.distributed.setup() first.")
    if compression is not None and compression not in COMPRESSIONS:
        raise ValueError(f"compression={compression!r} is unknown; use one of {COMPRESSIONS} or None.")
    device = next(model.parameters()).device
    if sync_batchnorm:
        if device.type != "cuda":
            raise ValueError(
                "sync_batchnorm=True needs CUDA: PyTorch's SyncBatchNorm runs on GPUs only (on CPU its forward "
                "raises). On CPU use a model without BatchNorm, or accept per-rank statistics."
            )
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model, process_group)
    wrapped = DistributedDataParallel(
        model,
        device_ids=[device] if device.type == "cuda" else None,
        bucket_cap_mb=bucket_cap_mb,
        process_group=process_group,
    )
    if compression is not None:
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        hook = default_hooks.fp16_compress_hook if compression == "fp16" else default_hooks.bf16_compress_hook
        wrapped.register_comm_hook(process_group, hook)
    return wrapped


def prepare(model: nn.Module) -> nn.Module:
    """What gk.fit trains: the model in DDP inside a distributed job, else the model itself.

    A model already wrapped (DDP, or sharded with FSDP2) is used as it is, so a lesson can pick
    DDP's options (bucket size, compression) by wrapping it itself.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return model
    if isinstance(model, DistributedDataParallel) or is_sharded(model):
        return model
    return data_parallel(model)


def no_sync(model: nn.Module, skip: bool) -> contextlib.AbstractContextManager:
    """Context for a micro-batch's forward and backward: with skip=True, the gradients stay local
    (no all-reduce); they are summed with the next micro-batch's and all-reduced once, at the
    optimizer step. Does nothing for a model that is not distributed."""
    if not skip:
        return contextlib.nullcontext()
    if isinstance(model, DistributedDataParallel):
        return model.no_sync()
    if is_sharded(model):
        return _fsdp_no_sync(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_no_sync(model) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def shard(loader):
    """This rank's part of a loader's data.

    A device-resident loader (DeviceLoader, TextLoader) gets its rank's share through
    `for_rank(rank, world_size)`: every rank draws the same permutation per epoch and takes an
    interleaved, equal share. A DataLoader must already read through a DistributedSampler.
    Every rank must call it (fit does, as it sets up): the ranks' batch counts are compared
    (check_same_batches), before a first step that would end in a timeout or a crash.
    """
    count = world_size()
    if count == 1:
        return loader
    if hasattr(loader, "for_rank"):
        loader = loader.for_rank(rank(), count)
    else:
        sampler = getattr(getattr(loader, "batch_sampler", None), "sampler", getattr(loader, "sampler", None))
        if not isinstance(sampler, DistributedSampler):
            raise ValueError(
                "in a distributed job each rank must read its own part of the data: pass the Dataset (fit shards "
                "it), or a DataLoader from gk.distributed.sharded_loader() (a DistributedSampler)."
            )
    check_same_batches(loader)
    return loader


def check_same_batches(loader) -> None:
    """Refuse, on every rank, training data that gives the ranks different numbers of batches per epoch (one
    all_gather_object; every rank must call it). The rank with more batches would wait in a collective that the
    others never join: measured, a gloo timeout or a SIGABRT ("Received data size doesn't match expected size").
    Data without len() cannot be counted before its epoch ends and is let through."""
    try:
        batches = len(loader)
    except TypeError:
        batches = None
    counts = objects_over_ranks(batches)
    if None in counts or len(set(counts)) == 1:
        return
    listed = ", ".join(f"rank {index}: {number}" for index, number in enumerate(counts))
    raise ValueError(
        f"the ranks' training data give different numbers of batches per epoch ({listed}): every rank must take the "
        "same steps, or the one with more waits for the others in a collective until it times out or crashes. Give "
        "every rank the same Dataset (fit gives each rank an equal share of it), or a DataLoader from "
        "gk.distributed.sharded_loader() over a dataset of the same length on every rank."
    )


def sharded_loader(dataset, batch_size: int, *, shuffle: bool = True, seed: int = 0, **options):
    """This rank's loader: a sharded device-resident loader for an ImageDataset or TokenDataset,
    else a DataLoader with a DistributedSampler. All reshuffle per epoch consistently across ranks
    (fit calls set_epoch)."""
    device = options.pop("device", default_device())
    return loader_for(
        dataset, batch_size, device, shuffle=shuffle, seed=seed, rank=rank(), world_size=world_size(), **options
    )


def broadcast_buffers(model: nn.Module, source: int = 0) -> None:
    """Give every rank the buffers of rank `source` (BatchNorm's running statistics, counters, your own).

    DDP copies rank 0's buffers to every rank at the start of each training forward, and each rank then
    updates them with its own part of the batch: after the last step they differ. Copying rank 0's, rather
    than averaging, keeps the chain of statistics DDP itself kept, is what rank 0 saves in a checkpoint,
    and suits buffers of every kind (an integer counter or a mask cannot be averaged). gk.fit calls this
    after every epoch, before evaluating. Nothing happens in one process; FSDP2's sharded tensors are left.
    """
    if world_size() == 1:
        return
    with torch.no_grad():
        for buffer in model.buffers():
            if not hasattr(buffer, "to_local"):  # a DTensor's shards differ by design
                dist.broadcast(buffer, src=source)


def average_parameters(model: nn.Module, group: dist.ProcessGroup | None = None) -> None:
    """Replace parameters and floating-point buffers by their mean over ranks (local SGD's sync)."""
    count = dist.get_world_size(group)
    with torch.no_grad():
        for tensor in [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]:
            dist.all_reduce(tensor, group=group)
            tensor.div_(count)


# ---------------------------------------------------------------------------------------------
# Sharded data parallelism (FSDP2)


def sharded_data_parallel(model: nn.Module, *, reshard_after_forward: bool = True) -> nn.Module:
    """Shard parameters, gradients and optimizer state over ranks with FSDP2 (`fully_shard`).

    Each rank keeps 1/world_size of every parameter. Before a block runs, its full parameters
    are all-gathered; after backward, gradients are reduce-scattered so each rank keeps the
    gradient of its own shard, and the optimizer updates only that shard. Each block (the
    children of the model's outermost nn.Sequential or nn.ModuleList: a transformer's layers,
    a CNN's stages; see gk.memory.find_blocks) becomes one unit, gathered and freed on
    its own; the root holds the rest, tied weights included. Build the optimizer after this
    call: the parameters become DTensors. Runs on CPU over gloo too.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if not dist.is_initialized():
        raise RuntimeError("sharded_data_parallel needs a process group: call gk.distributed.setup() first.")
    device = next(model.parameters()).device
    mesh = init_device_mesh(device.type, (world_size(),))
    for _, block, _ in find_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    return model


def is_sharded(model: nn.Module) -> bool:
    """True for a model sharded with FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return False
    return isinstance(model, FSDPModule)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor: the local shard of a DTensor, the tensor itself otherwise."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds for parameters, gradients and optimizer state (its shards only).

    Not counted: activations (they depend on the batch and are freed after backward), and DDP's
    communication buckets, a second copy of the gradients unless DDP was built with
    gradient_as_bucket_view=True. On a GPU, torch.cuda.max_memory_allocated sees everything.
    """
    parameters = list(model.parameters())
    sizes = {
        "parameters": sum(_local(p).nbytes for p in parameters),
        "gradients": sum(_local(p.grad).nbytes for p in parameters if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        for state in optimizer.state.values():
            sizes["optimizer"] += sum(_local(v).nbytes for v in state.values() if isinstance(v, torch.Tensor))
    sizes["total"] = sum(sizes.values())
    return sizes
