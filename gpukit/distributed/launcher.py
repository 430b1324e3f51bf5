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

import contextlib
import faulthandler
import json
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch

from .. import env
from ..files import write_atomic  # the parent never reads half a file
from ..preemption import EXIT_PREEMPTED, Preempted, end_with_parent, sigterm_raises
from ..validation import check_int

BACKENDS = ("nccl", "gloo")
START_METHODS = ("spawn", "fork")
HOST = "127.0.0.1"  # launch starts every worker on this machine
STOP_GRACE_SECONDS = 5.0  # how long a stopped worker gets to exit after SIGTERM before SIGKILL
POLL_SECONDS = 0.1  # how often the parent checks the workers and forwards their output
STACK_SECONDS = 2.0  # how long a rank still running gets to write its stack (faulthandler) before it is stopped
STACK_SIGNAL = getattr(signal, "SIGUSR1", None)  # asks a worker for its Python stack (None on Windows)


class WorkerError(RuntimeError):
    """A rank raised an exception or died. `rank`, `exception` (the rank's exception, when it
    could be sent back, else None) and `remote_traceback` (text) say which and why."""

    def __init__(self, message: str, rank: int, exception: BaseException | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = remote_traceback


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


# ---------------------------------------------------------------------------------------------
# Inside each worker


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


# ---------------------------------------------------------------------------------------------
# In the parent: watch, forward output, stop, collect


class _OutputForwarder:
    """Prints what each rank wrote to its log file since the last call, line by line, prefixed."""

    def __init__(self, run_dir: Path, nprocs: int):
        self.paths = [run_dir / f"rank{rank}.log" for rank in range(nprocs)]
        self.offsets = [0] * nprocs
        self.partial = [""] * nprocs

    def forward(self, final: bool = False) -> None:
        for rank, path in enumerate(self.paths):
            try:
                with open(path, "rb") as file:
                    file.seek(self.offsets[rank])
                    chunk = file.read()
            except FileNotFoundError:
                continue
            self.offsets[rank] += len(chunk)
            lines = (self.partial[rank] + chunk.decode("utf-8", errors="replace")).split("\n")
            self.partial[rank] = "" if final else lines.pop()
            for line in lines:
                if line or not final:
                    # A progress bar rewrites its line with carriage returns: show its latest state.
                    print(f"[rank {rank}] {line.rsplit(chr(13), 1)[-1]}", flush=True)


def _wait(processes, output: _OutputForwarder, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        running = [p for p in processes if p.exitcode is None]
        if running:
            wait([p.sentinel for p in running], timeout=POLL_SECONDS)
        output.forward()
        failed = [rank for rank, p in enumerate(processes) if p.exitcode not in (None, 0)]
        if failed:
            run_dir = Path(output.paths[0]).parent
            stuck = _stuck_ranks(run_dir, failed, processes)
            stacks = _dump_stacks(run_dir, stuck, processes)  # before they are stopped
            _stop(processes)
            output.forward(final=True)
            raise _worker_error(run_dir, failed, processes, stacks) from None
        if all(p.exitcode == 0 for p in processes):
            return
        if deadline is not None and time.monotonic() > deadline:
            still = [rank for rank, p in enumerate(processes) if p.exitcode is None]
            _stop(processes)
            output.forward(final=True)
            raise TimeoutError(
                f"launch stopped the workers after timeout={timeout} s; rank(s) {still} were still running. "
                "Raise the timeout, or look for a rank waiting on a collective that the others never call."
            )


def _stop(processes) -> None:
    """SIGTERM every worker still running, a second SIGTERM to those still running halfway through the grace period
    (fit hears the first as a request to save after its step, and the second as a stop at once: its note names the
    last save), then SIGKILL those that outlive it."""
    alive = [p for p in processes if p.exitcode is None]
    for process in alive:
        process.terminate()
    deadline = time.monotonic() + STOP_GRACE_SECONDS
    for process in alive:
        process.join(max(0.0, deadline - STOP_GRACE_SECONDS / 2 - time.monotonic()))
    for process in alive:
        if process.exitcode is None:
            process.terminate()
    for process in alive:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.exitcode is None:
            process.kill()
            process.join()


def _reports(run_dir: Path, ranks) -> dict[int, dict]:
    """The error reports (_write_error) of those of `ranks` that wrote one, by rank."""
    reports = {}
    for rank in ranks:
        try:
            reports[rank] = json.loads((run_dir / f"rank{rank}.error").read_text())
        except (FileNotFoundError, ValueError):
            pass
    return reports


def _stuck_ranks(run_dir: Path, failed: list[int], processes) -> list[int]:
    """The ranks still running, with no error of their own, when every rank that failed did so in the collective
    backend (a timeout, a lost peer): they never joined the collective the others waited in. Else none."""
    reports = _reports(run_dir, range(len(processes)))
    if any(rank not in reports or not reports[rank].get("backend") for rank in failed):
        return []  # a rank that died, or raised an error of its own: that is the cause
    return [rank for rank, p in enumerate(processes) if p.exitcode is None and rank not in reports]


def _dump_stacks(run_dir: Path, ranks: list[int], processes) -> dict[int, str]:
    """Each of `ranks`' Python stacks, which it writes on STACK_SIGNAL (faulthandler: even from inside C code)."""
    if STACK_SIGNAL is None or not ranks:
        return {}
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(processes[rank].pid, STACK_SIGNAL)
    paths = {rank: run_dir / f"rank{rank}.stack" for rank in ranks}
    deadline = time.monotonic() + STACK_SECONDS
    while time.monotonic() < deadline and not all(path.exists() and path.stat().st_size for path in paths.values()):
        time.sleep(POLL_SECONDS)
    time.sleep(POLL_SECONDS)  # the last lines of a dump still being written
    return {
        rank: _own_threads(path.read_text(errors="replace")) if path.exists() else "" for rank, path in paths.items()
    }


def _own_threads(dump: str) -> str:
    """faulthandler's dump without the threads of gpukit's own watcher (preemption.end_with_parent)."""
    blocks = [block for block in dump.strip().split("\n\n") if block]
    kept = [block for block in blocks if "preemption.py" not in block]
    return "\n\n".join(kept or blocks)


def _worker_error(run_dir: Path, failed: list[int], processes, stacks: dict[int, str]) -> Exception:
    """The error of the rank that caused the failure. A rank that died without a Python exception
    (killed, crashed) comes first: the others' errors are then only their lost connections to it.
    Then a rank stuck outside the collective the others failed in (`stacks`: the stuck ranks' stacks).
    Among Python exceptions, the earliest that the backend did not raise: those are others losing their peer.
    A rank stopped by SIGTERM makes the whole launch Preempted."""
    reports = _reports(run_dir, failed)
    nprocs = len(processes)
    abrupt = [rank for rank in failed if rank not in reports]
    if abrupt:
        rank = abrupt[0]
        code = processes[rank].exitcode
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            how = f"was killed by {name}" + (" (out of memory, or killed by hand?)" if name == "SIGKILL" else "")
        else:
            how = f"exited with code {code} before returning, without a Python exception (sys.exit, os._exit or a crash in C code?)"
        return WorkerError(f"rank {rank} of {nprocs} {how}; the other ranks were stopped.", rank)
    if stacks:
        return _stuck_error(reports, stacks, nprocs)
    causes = [report for report in reports.values() if not report.get("backend")] or list(reports.values())
    first = min(causes, key=lambda report: report["time"])
    if first["type"] == Preempted.__name__:
        return Preempted(f"rank {first['rank']} of {nprocs} was {first['message']}")
    exception = None
    if first["exception"] is not None:
        try:
            exception = pickle.loads(bytes.fromhex(first["exception"]))
        except Exception:
            exception = None  # its class cannot be rebuilt here; the traceback text says it all
    message = (
        f"rank {first['rank']} of {nprocs} failed with {first['type']}: {first['message']}\n\n"
        f"--- traceback from rank {first['rank']} ---\n{first['traceback']}"
    )
    return WorkerError(message, first["rank"], exception, first["traceback"])


def _stuck_error(reports: dict[int, dict], stacks: dict[int, str], nprocs: int) -> WorkerError:
    """The stuck rank named, where it was, and what to do; the error of the rank that waited for it, in brief."""
    rank = min(stacks)
    waited = min(reports.values(), key=lambda report: report["time"])
    stack = stacks[rank] or "(it wrote no stack within the time given)"
    message = (
        f"rank {rank} of {nprocs} is stuck: it was still running when rank {waited['rank']} gave up waiting in a "
        f"collective that rank {rank} never joined ({waited['type']}: {waited['message']}). Look at what rank {rank} "
        "does that the others do not (reads more data, waits for input or a lock, calls another collective), or, if "
        "it is only slower, raise the collective timeout: gk.distributed.setup(timeout=...) or the environment "
        f"variable GPUKIT_COLLECTIVE_TIMEOUT.\n\n--- where rank {rank} was (most recent call first) ---\n{stack}"
    )
    return WorkerError(message, rank, None, stack)


def _preempted(reason: str, run_dir: Path, nprocs: int) -> str:
    """One line: why launch stopped, and what the lowest rank that was stopped by SIGTERM said (fit's note: how
    far it got and which save resumes the run)."""
    said = [report for report in _reports(run_dir, range(nprocs)).values() if report["type"] == Preempted.__name__]
    line = f"launch: {reason}; its {nprocs} workers were stopped."
    if said:
        first = min(said, key=lambda report: report["rank"])
        line += f" Rank {first['rank']}: {' '.join(first['notes']) or first['message']}"
    else:
        line += " None said how far it got (stopped before it began, or killed)."
    return " ".join(line.split())


def _read_result(run_dir: Path, rank: int):
    path = run_dir / f"rank{rank}.result"
    if not path.exists():
        raise WorkerError(f"rank {rank} ended without returning a result; did the function call sys.exit()?", rank)
    return pickle.loads(path.read_bytes())
