"""This process in a distributed job: `setup` joins the process group and picks the device, `cleanup` leaves it;
where this rank stands (rank, world_size, is_main, default_device); and the collectives that keep metrics and
counts the same on every rank. See the package docstring for the whole story."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .. import env, preemption

DEFAULT_TIMEOUT_SECONDS = 300.0  # a rank waiting longer than this on a collective raises instead of hanging


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
