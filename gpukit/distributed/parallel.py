"""Training on several processes: setup inside a worker, data parallelism (DDP), sharded data,
collectives, and sharded data parallelism (FSDP2). See the package docstring for the whole story."""

from __future__ import annotations

import contextlib
import os
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DistributedSampler

from .. import env, preemption
from ..data.loaders import loader_for
from ..memory.activation_checkpointing import find_blocks

DEFAULT_TIMEOUT_SECONDS = 300.0  # a rank waiting longer than this on a collective raises instead of hanging
COMPRESSIONS = ("fp16", "bf16")  # DDP gradient compression hooks: all-reduce half the bytes


@dataclass(frozen=True)
class Worker:
    """Where this process stands in the job."""

    rank: int  # 0 .. world_size-1 across all machines
    world_size: int
    device: torch.device  # cuda:LOCAL_RANK with NCCL, cpu with gloo
    local_rank: int  # index of this process on its machine
    backend: str

    @property
    def is_main(self) -> bool:
        return self.rank == 0


_worker: Worker | None = None  # set by setup(), cleared by cleanup()
_sigterm_before: object = None  # the SIGTERM handler setup() replaced in a worker, put back by cleanup()


def setup(backend: str | None = None, *, timeout: float | None = None) -> Worker:
    """Join the process group described by the environment and pick this process's device.

    Reads RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT (set by torchrun, by
    `launch`, or by hand in a cluster job). Without them, this process is a world of one (an
    in-memory store), so the same code also runs in a plain script or notebook.

    backend: "nccl" (one CUDA GPU per process, selected by LOCAL_RANK) or "gloo" (CPU); default
             what `launch` asked for, else NCCL when CUDA is available, else gloo.
    timeout: seconds a collective may wait for the other ranks before it raises; default the
             environment variable GPUKIT_COLLECTIVE_TIMEOUT, else 300.
    Calling setup again returns the same Worker. In a notebook's own process on a GPU machine,
    setup initialises CUDA there: later launches still work (they spawn), fork is refused.

    In a job (WORLD_SIZE set), until cleanup(): SIGTERM raises gk.preemption.Preempted in the main
    thread, as Ctrl-C raises KeyboardInterrupt (fit then notes which save resumes the run), and a
    worker started by torchrun ends when its torchrun agent dies (gk.preemption.end_with_parent):
    torchrun starts workers in sessions of their own, which no Ctrl-C reaches, and they trained on
    as orphans of an agent killed outright.
    """
    global _worker, _sigterm_before
    if dist.is_initialized():
        if _worker is None:  # the group was made without setup (init_process_group by hand): describe it
            backend = dist.get_backend()
            device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            _worker = Worker(dist.get_rank(), dist.get_world_size(), device, local_rank, backend)
        return _worker
    in_job = "WORLD_SIZE" in os.environ
    if in_job:
        missing = [name for name in ("RANK", "MASTER_ADDR", "MASTER_PORT") if name not in os.environ]
        if missing:
            raise ValueError(
                f"WORLD_SIZE is set but {', '.join(missing)} is not: start workers with torchrun or "
                "gk.distributed.launch, which set all of RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT."
            )
    if in_job:
        _stop_with_the_job()
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    backend = backend or os.environ.get("GPUKIT_BACKEND") or ("nccl" if _cuda_available(in_job) else "gloo")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' (GPUs) or 'gloo' (CPU).")
    device = torch.device("cpu")
    if backend == "nccl":
        count = torch.cuda.device_count()
        if local_rank >= count:
            raise ValueError(
                f"LOCAL_RANK={local_rank} needs GPU cuda:{local_rank}, but this machine shows {count} GPU(s); "
                f"start at most {count} processes per machine (torchrun --nproc-per-node={count}), or use gloo."
            )
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if timeout is None:
        timeout = float(os.environ.get("GPUKIT_COLLECTIVE_TIMEOUT", DEFAULT_TIMEOUT_SECONDS))
    options = {"backend": backend, "timeout": timedelta(seconds=timeout)}
    if backend == "nccl":
        options["device_id"] = device  # binds the communicator to this GPU now, not lazily
    if in_job:
        dist.init_process_group(**options)  # env:// rendezvous: MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE
    else:
        dist.init_process_group(**options, store=dist.HashStore(), rank=0, world_size=1)
    _worker = Worker(dist.get_rank(), dist.get_world_size(), device, local_rank, backend)
    _warn_if_restarts_may_fail()
    return _worker


def _stop_with_the_job() -> None:
    """SIGTERM raises Preempted until cleanup(); a torchrun worker ends with its agent (setup's docstring)."""
    global _sigterm_before
    if "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun's agent, this process's parent
        preemption.end_with_parent()
    previous = preemption.catch_sigterm()
    if previous is not None:
        _sigterm_before = previous


def _warn_if_restarts_may_fail() -> None:
    """torchrun keeps one store for all attempts of a job, shared with the workers, unless it uses c10d
    rendezvous with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1. A restarted group can then read the previous
    attempt's addresses and fail to connect (`Gloo connectFullMesh failed ... Connection refused`) or hang
    (pytorch/pytorch#135712). Measured on this kit's fault drill (torch 2.14): 3 of 3 restarts failed with
    c10d and a shared store, 2 of 3 with static rendezvous, which the variable does not change. Static is
    what `torchrun --nproc-per-node=N` alone used before torch 2.14 (and --master-port or --nnodes without
    --rdzv-backend still use); it failed the drill on torch 2.11 with the variable set."""
    restarts = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0))
    if restarts > 0 and os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and is_main():
        if os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1":
            fix = (
                "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set, so torchrun uses static rendezvous, which keeps its "
                "store whatever the variable says: add --standalone (one machine) or --rdzv-backend=c10d "
                "--rdzv-endpoint=HOST:PORT --rdzv-id=JOB (several)."
            )
        else:
            fix = (
                "Start torchrun with the environment variable TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and c10d "
                "rendezvous: --standalone (one machine) or --rdzv-backend=c10d (several)."
            )
        warnings.warn(
            "torchrun was started with --max-restarts but keeps one store, shared with the workers, for every "
            f"attempt, so a restarted group may fail to connect or hang (pytorch/pytorch#135712). {fix}",
            stacklevel=3,
        )


def _cuda_available(in_job: bool) -> bool:
    if in_job:
        return torch.cuda.is_available()  # a worker process may initialise CUDA

    return env.detect().device == "cuda"  # asks NVML: a notebook must stay able to launch workers


def cleanup() -> None:
    """Leave the process group (call at the end of a worker function); SIGTERM's handler as it was before setup."""
    global _worker, _sigterm_before
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    _worker = None
    preemption.restore_sigterm(_sigterm_before)
    _sigterm_before = None


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def is_main() -> bool:
    """True on rank 0, and in a process that is not part of a distributed job."""
    return rank() == 0


def default_device() -> torch.device | None:
    """The device setup() chose for this process, or None outside a distributed job."""
    return _worker.device if _worker is not None and dist.is_initialized() else None


def print0(*args, **kwargs) -> None:
    """print() on rank 0 only, so that a message appears once, not once per process."""
    if is_main():
        print(*args, **{"flush": True, **kwargs})


def barrier() -> None:
    """Wait until every rank gets here (nothing to wait for in a single process)."""
    if world_size() > 1:
        dist.barrier()


# ---------------------------------------------------------------------------------------------
# Metrics over ranks


def mean_over_ranks(tensor: torch.Tensor) -> torch.Tensor:
    """The mean of `tensor` over all ranks (an all-reduce); the tensor itself in one process."""
    if world_size() == 1:
        return tensor
    total = tensor.detach().clone()
    dist.all_reduce(total)
    return total / world_size()


def sum_over_ranks(*values: torch.Tensor | int | float) -> tuple:
    """Sums of tensors (0-d) and numbers over all ranks in one all-reduce, in their own types."""
    if world_size() == 1:
        return values
    device = default_device() or torch.device("cpu")
    packed = torch.stack([torch.as_tensor(value, dtype=torch.float64, device=device).reshape(()) for value in values])
    dist.all_reduce(packed)
    return tuple(
        packed[i].to(value.dtype) if isinstance(value, torch.Tensor) else type(value)(packed[i].item())
        for i, value in enumerate(values)
    )


def names_over_ranks(names: list[str]) -> list[str]:
    """Every rank's names, each once, in the order rank 0, 1, … first list them: the same list on every rank
    (one all_gather_object), so that sums named by them can be all-reduced in one order. A rank that saw no
    batch of the held-out data knows no loss parts or metric columns: it learns them here."""
    if world_size() == 1:
        return list(names)
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, list(names))
    return list(dict.fromkeys(name for rank_names in gathered for name in rank_names))


def objects_over_ranks(value) -> list:
    """Every rank's `value` (any picklable object), in rank order: one all_gather_object, which every rank must
    call; [value] in one process."""
    if world_size() == 1:
        return [value]
    gathered: list = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def check_same(value: int, what: str) -> None:
    """Raise on every rank if ranks disagree on an integer (a resume epoch, a step count)."""
    if world_size() == 1:
        return
    device = default_device() or torch.device("cpu")
    bounds = torch.tensor([value, -value], dtype=torch.int64, device=device)
    dist.all_reduce(bounds, op=dist.ReduceOp.MAX)
    highest, lowest = int(bounds[0]), -int(bounds[1])
    if highest != lowest:
        raise RuntimeError(
            f"ranks disagree on {what}: values from {lowest} to {highest} (this rank: {value}). Every rank must "
            "see the same files: put checkpoint_dir on a filesystem that all machines share."
        )


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
