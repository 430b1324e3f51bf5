"""Inside each worker that gk.distributed.launch starts: its output sent to a log file the parent forwards, the
environment torchrun would set (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), the function run, and its
result, or its error, written for the parent to read (launch_watch.py)."""

from __future__ import annotations

import faulthandler
import json
import os
import pickle
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..files import write_atomic  # the parent never reads half a file
from ..preemption import EXIT_PREEMPTED, Preempted, end_with_parent, sigterm_raises

HOST = "127.0.0.1"  # launch starts every worker on this machine
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a worker for its Python stack (None on Windows)


@dataclass(frozen=True)
class _Config:
    """What every worker needs; pickled to spawned workers (small: the function travels as bytes)."""

    run_dir: str
    nprocs: int
    port: int
    backend: str
    threads: int  # CPU threads per worker (torch intra-op)
    payload: bytes | None  # cloudpickle of (fn, args); None with fork, where `function` is inherited
    parent_pid: int  # the launcher: a worker whose launcher dies ends too (gpukit.preemption.end_with_parent)
    function: Any = None


def _worker_main(local_rank: int, config: _Config) -> None:
    """Entry point of every worker (called by torch.multiprocessing as fn(index, *args))."""
    end_with_parent(config.parent_pid)  # first: a launcher that dies from here on takes this worker with it
    run_dir = Path(config.run_dir)
    _send_output_to(run_dir / f"rank{local_rank}.log")
    if STACK_SIGNAL is not None:  # the parent asks a rank that seems stuck where it is (_dump_stacks)
        stacks = open(run_dir / f"rank{local_rank}.stack", "w")  # noqa: SIM115 (open while the process lives)
        faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True)
    os.environ.update(
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(config.nprocs),
        LOCAL_WORLD_SIZE=str(config.nprocs),
        MASTER_ADDR=HOST,
        MASTER_PORT=str(config.port),
        GPUKIT_BACKEND=config.backend,
        OMP_NUM_THREADS=str(config.threads),
    )
    torch.set_num_threads(config.threads)
    try:
        with sigterm_raises():  # SIGTERM raises Preempted: fit says how far it got and which save resumes
            if config.payload is not None:
                import cloudpickle  # noqa: F401  (pickle.loads needs it importable for by-value functions)

                fn, args = pickle.loads(config.payload)
            else:
                fn, args = config.function
            result = fn(*args)
        data = _result_bytes(result, local_rank)
    except Preempted as error:
        _write_error(run_dir, local_rank, error)
        sys.exit(EXIT_PREEMPTED)  # (torch.multiprocessing would end a KeyboardInterrupt with exit code 0)
    except Exception as error:
        _write_error(run_dir, local_rank, error)
        raise  # torch.multiprocessing records it and exits with code 1
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()  # the function forgot gk.distributed.cleanup()
    write_atomic(run_dir / f"rank{local_rank}.result", data)


def _send_output_to(path: Path) -> None:
    """Send this process's stdout and stderr (Python's and C's, file descriptors 1 and 2) to `path`."""
    stream = open(path, "w", buffering=1, encoding="utf-8", errors="replace")  # line-buffered
    os.dup2(stream.fileno(), 1)
    os.dup2(stream.fileno(), 2)
    sys.stdout = sys.stderr = stream  # a forked child must not write to the parent's notebook streams


def _to_cpu(value):
    """Tensors become CPU copies: the parent must not touch CUDA, and a worker's shared memory
    disappears when it exits."""
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return type(value)((key, _to_cpu(item)) for key, item in value.items())
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return type(value)(_to_cpu(item) for item in value)
    return value


def _result_bytes(result, rank: int) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps(_to_cpu(result))
    except Exception as error:
        raise TypeError(
            f"rank {rank} returned a {type(result).__name__} that cannot be sent back to the caller ({error}); "
            "return numbers, strings, lists, dicts or CPU tensors."
        ) from error


def _write_error(run_dir: Path, rank: int, error: BaseException) -> None:
    import cloudpickle

    try:
        pickled = cloudpickle.dumps(error).hex()
    except Exception:
        pickled = None
    report = {
        "rank": rank,
        "time": time.time(),
        "type": type(error).__name__,
        "message": str(error),
        "notes": list(getattr(error, "__notes__", [])),
        "traceback": traceback.format_exc(),
        "exception": pickled,
        "backend": _from_the_backend(error),
    }
    write_atomic(run_dir / f"rank{rank}.error", json.dumps(report).encode())


def _from_the_backend(error: BaseException) -> bool:
    """Whether the collective backend raised `error` (a timeout, a lost peer): a consequence of what another rank
    did, not a cause. NCCL's failures are DistErrors; torch 2.14 raises gloo's as plain RuntimeErrors that begin with
    gloo's source path ("[.../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 3000ms ..."), and no type
    tells them apart, so their text is read."""
    if torch.distributed.is_available() and isinstance(error, torch.distributed.DistError):
        return True
    message = str(error)
    return type(error) is RuntimeError and message.startswith("[") and "/gloo/" in message.split("]", 1)[0]
