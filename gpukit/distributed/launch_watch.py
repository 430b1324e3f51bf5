"""In the parent of the workers gk.distributed.launch starts: forward their output, watch for a rank that fails or
is stuck, stop them all, and collect each rank's result or the error that explains the failure."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import signal
import time
from multiprocessing.connection import wait
from pathlib import Path

from ..preemption import Preempted
from .launch_worker import STACK_SIGNAL

STOP_GRACE_SECONDS = 5.0  # how long a stopped worker gets to exit after SIGTERM before SIGKILL
POLL_SECONDS = 0.1  # how often the parent checks the workers and forwards their output
STACK_SECONDS = 2.0  # how long a rank still running gets to write its stack (faulthandler) before it is stopped


class WorkerError(RuntimeError):
    """A rank raised an exception or died. `rank`, `exception` (the rank's exception, when it
    could be sent back, else None) and `remote_traceback` (text) say which and why."""

    def __init__(self, message: str, rank: int, exception: BaseException | None = None, remote_traceback: str = ""):
        super().__init__(message)
        self.rank = rank
        self.exception = exception
        self.remote_traceback = remote_traceback


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
