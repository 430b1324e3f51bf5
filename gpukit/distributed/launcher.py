"""A notebook-safe multi-process launcher: `launch(fn)` runs `fn` in one process per GPU (or in
several CPU processes), returns every rank's return value, and shows every rank's output.

Why spawn, not fork, by default (measured, see the docstring of `launch`):
- fork after the parent ran a multi-threaded CPU op hangs workers that use more than one thread
  (GNU OpenMP is not fork-safe), and lessons train before they launch;
- fork after CUDA was initialised in the parent fails in the workers;
- fork on a machine with a CUDA device fails in the workers' first backward once the parent has run
  any backward, even on the CPU (autograd's device threads, see `fork_refusal`).
Spawned workers start a fresh interpreter instead, so neither can happen; the function travels
to them by value with cloudpickle, so functions and globals defined in notebook cells work.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from .. import env
from ..preemption import Preempted, sigterm_raises
from ..validation import check_int

# What the parent does while the workers run (launch_watch.py), and what runs inside each (launch_worker.py).
from .launch_watch import (
    POLL_SECONDS,
    STACK_SECONDS,
    STOP_GRACE_SECONDS,
    WorkerError,
    _OutputForwarder,
    _preempted,
    _read_result,
    _stop,
    _wait,
)
from .launch_worker import HOST, STACK_SIGNAL, _Config, _worker_main

__all__ = [
    "BACKENDS",
    "HOST",
    "POLL_SECONDS",
    "STACK_SECONDS",
    "STACK_SIGNAL",
    "START_METHODS",
    "STOP_GRACE_SECONDS",
    "WorkerError",
    "fastest_start_method",
    "fork_refusal",
    "launch",
]

BACKENDS = ("nccl", "gloo")
START_METHODS = ("spawn", "fork")


def launch(
    fn: Callable,
    nprocs: int | None = None,
    *args,
    backend: str | None = None,
    start_method: str = "spawn",
    port: int | None = None,
    timeout: float | None = None,
) -> list:
    """Run `fn(*args)` in `nprocs` worker processes and return their return values, rank by rank.

    Inside `fn`, call `gk.distributed.setup()`: it reads RANK, WORLD_SIZE, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT from the environment, which `launch` sets exactly as torchrun
    does, so the same function runs unchanged under torchrun on one or many machines.

    nprocs:  default one per GPU with NCCL; without a CUDA GPU, 2 CPU processes over gloo that
             split this machine's cores between them (torch.set_num_threads in each).
    backend: "nccl" (default with CUDA GPUs) or "gloo" (CPU; default without GPUs).
    start_method: "spawn" (default) starts fresh interpreters and sends `fn` by value with
             cloudpickle: it works from notebooks, also after the parent ran CPU work or touched
             CUDA. "fork" starts faster (no re-import of torch, ~3 s saved per launch) but is
             refused once CUDA is initialised here or wherever a CUDA device is visible
             (`fork_refusal` says why; `fastest_start_method()` picks for you), and runs each
             worker with one CPU thread, because workers forked from a parent that already used OpenMP hang in their first
             multi-threaded op (measured with torch 2.14 and GNU OpenMP).
    port:    rendezvous port on 127.0.0.1; default a free one picked now.
    timeout: seconds for the whole run; None waits as long as the workers run. Collectives have
             their own timeout (see gk.distributed.setup), so waiting ranks never hang forever.

    Each rank's printed output appears here, prefixed with `[rank N]`. When a rank raises or
    dies, the other ranks are stopped and a WorkerError with that rank's traceback is raised; when a
    rank fails in a collective that another rank, still running, never joined, the error names that
    stuck rank and shows its Python stack.
    From a script, call launch under `if __name__ == "__main__":` (spawn re-imports the script).

    Stopping: SIGTERM (a batch job preempted, `kill`) stops launch as Ctrl-C does, also where SIGINT
    is ignored (`python train.py &` in a batch script): every worker gets SIGTERM, which raises
    gk.preemption.Preempted inside it (inside fit, after the run is saved at the end of its step; a second
    SIGTERM halfway through STOP_GRACE_SECONDS stops it at once; fit's note says which save resumes), and launch raises
    Preempted with one line saying what rank 0 said. Workers end with a launcher that dies any other
    way too (SIGKILL, a closed notebook): gk.preemption.end_with_parent.
    """
    if not callable(fn):
        raise TypeError(f"launch needs a function to run in each worker, got {type(fn).__name__}.")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method={start_method!r} is unknown; use 'spawn' (the safe default) or 'fork'.")
    if timeout is not None and timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds or None, got {timeout!r}.")
    port = _free_port() if port is None else _check_port(port)  # before the backend: its errors depend on GPUs
    backend, nprocs = _check_backend_and_nprocs(backend, nprocs)
    if start_method == "fork":
        _check_fork_is_safe()
        payload, threads = None, 1
    else:
        payload, threads = _serialise(fn, args), max(1, (os.cpu_count() or 1) // nprocs)

    run_dir = tempfile.mkdtemp(prefix="gpukit-launch-")
    function = (fn, args) if payload is None else None
    config = _Config(run_dir, nprocs, port, backend, threads, payload, os.getpid(), function)
    output = _OutputForwarder(Path(run_dir), nprocs)
    processes = []
    try:
        with sigterm_raises():  # SIGTERM stops the workers as Ctrl-C does, even where SIGINT is ignored
            context = torch.multiprocessing.start_processes(
                _worker_main, args=(config,), nprocs=nprocs, join=False, start_method=start_method
            )
            processes = context.processes
            _wait(processes, output, timeout)
        return [_read_result(Path(run_dir), rank) for rank in range(nprocs)]
    except Preempted as stopped:  # here or in a worker: every worker gets SIGTERM and says how far it got
        _stop(processes)
        output.forward(final=True)
        raise Preempted(_preempted(str(stopped), Path(run_dir), nprocs)) from None
    finally:
        _stop(processes)
        output.forward(final=True)
        shutil.rmtree(run_dir, ignore_errors=True)


# ---------------------------------------------------------------------------------------------
# Checks before anything starts


def _check_backend_and_nprocs(backend: str | None, nprocs: int | None) -> tuple[str, int]:
    gpu_count = env.detect().gpu_count  # asks NVML, never the CUDA runtime: the parent stays CUDA-free
    backend = backend if backend is not None else ("nccl" if gpu_count else "gloo")
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; use 'nccl' (one GPU per process) or 'gloo' (CPU).")
    if backend == "nccl" and gpu_count == 0:
        raise ValueError("backend='nccl' needs CUDA GPUs and this machine has none; use backend='gloo'.")
    if nprocs is None:
        nprocs = gpu_count if backend == "nccl" else 2
    check_int("nprocs", nprocs, note="(processes)")
    if backend == "nccl":
        if not torch.distributed.is_nccl_available():
            raise ValueError("backend='nccl' is not available in this build of PyTorch; use backend='gloo'.")
        if nprocs > gpu_count:
            raise ValueError(
                f"NCCL needs one GPU per process: nprocs={nprocs} but this machine has {gpu_count} CUDA GPU(s). "
                f"Use nprocs <= {gpu_count}, or backend='gloo' to run CPU processes."
            )
    return backend, nprocs


def fork_refusal() -> str | None:
    """Why forked workers would fail here, or None where fork is safe (one CPU thread per worker then).

    - CUDA initialised in this process: forked workers cannot use it.
    - A CUDA device visible (torch.cuda.device_count() > 0, which asks NVML and leaves CUDA uninitialised):
      autograd's first backward in this process, even one run on the CPU, starts a thread per device
      (`start_device_threads`) and marks every process forked afterwards as unable to run backward
      (`track_bad_autograd_forks`). Whether a backward has run cannot be read from Python, so fork is refused
      on any machine with a CUDA device. The H100 run of 2026-11-24 (run 3) failed so in lesson 04.
    """
    if torch.cuda.is_initialized():
        return (
            "CUDA is already initialised in this process, and forked workers cannot use it. Use "
            "start_method='spawn' (the default), or restart the kernel and launch before anything touches "
            "the GPU, or run the code as a script with torchrun."
        )
    devices = torch.cuda.device_count()
    if devices:
        return (
            f"this machine shows {devices} CUDA device(s): after any backward in this process (even one on the "
            "CPU) autograd runs a thread per device, and a forked worker's backward then fails with \"Unable to "
            "handle autograd's threading in combination with fork-based multiprocessing\". Use "
            "start_method='spawn' (the default), or run the code as a script with torchrun."
        )
    return None


def fastest_start_method() -> str:
    """'fork' where forked workers can run everything (see fork_refusal), else 'spawn'."""
    return "spawn" if fork_refusal() else "fork"


def _check_fork_is_safe() -> None:
    reason = fork_refusal()
    if reason:
        raise RuntimeError(reason)


def _serialise(fn: Callable, args: tuple) -> bytes:
    import cloudpickle

    try:
        return cloudpickle.dumps((fn, args))
    except Exception as error:  # pickle raises TypeError, PicklingError, AttributeError… for unpicklable objects
        raise TypeError(
            f"launch cannot send {getattr(fn, '__name__', fn)!r} or its arguments to the worker processes: "
            f"{type(error).__name__}: {error}. Create such objects (locks, open files, sockets, CUDA "
            "tensors…) inside the function instead of capturing them, or use start_method='fork'."
        ) from error


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((HOST, 0))  # the OS picks a port that is free now
        return probe.getsockname()[1]


def _check_port(port: int) -> int:
    check_int("port", port, maximum=65535)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as torch's TCPStore binds
        try:
            probe.bind((HOST, port))
        except OSError as error:
            raise ValueError(
                f"port {port} on {HOST} is in use ({error.strerror}); pass another port, or leave port=None "
                "so that launch picks a free one."
            ) from error
    return port
