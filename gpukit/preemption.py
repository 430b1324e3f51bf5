"""Stopped from outside: SIGTERM, and a launcher that dies.

SIGTERM is how Slurm and Kubernetes preempt a job and how torchrun stops its workers; a batch script's
`python train.py &` runs with SIGINT ignored, so SIGTERM is the only stop such a process hears. Two pieces:

- `sigterm_raises()`: while it is active, SIGTERM raises `Preempted` in the main thread, exactly where Ctrl-C
  raises KeyboardInterrupt. `Preempted` is a KeyboardInterrupt, so everything that handles Ctrl-C handles it:
  fit drops the unfinished step and notes how far it got and which save last.pt holds (a resume from it is
  exact: tests/test_interrupts.py), `gpukit train` ends with one line and exit code 143, launch stops its workers.
- `end_with_parent()`: a worker process ends when the process that started it dies, however it died (SIGKILL, an
  out-of-memory kill, a closed notebook): on Linux the kernel sends it SIGTERM (prctl PR_SET_PDEATHSIG), elsewhere
  a thread that polls the parent does; a worker still alive GRACE_SECONDS later is ended outright. Without it, the
  workers of a dead launcher trained on as orphans (torch.multiprocessing asks for SIGINT on the parent's death,
  which a worker started with SIGINT ignored never hears).

A second SIGTERM while the first unwinds is ignored: whoever sent it ends the process with SIGKILL if it must
(torchrun after 30 s, Slurm after its KillWait, launch after STOP_GRACE_SECONDS).

`sigterm_requests_a_stop()` is the gentler form for a training loop that saves before it stops (the work since the
last save is kept): the first SIGTERM only sets `StopRequest.asked`; the loop finishes its step, saves, and raises
`request.preempted()`; a second SIGTERM raises Preempted at once (not the one end_with_parent's thread sends after
the kernel's: that is the same news). fit uses it while it trains (gpukit/train/loop.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator

__all__ = [
    "EXIT_PREEMPTED",
    "GRACE_SECONDS",
    "Preempted",
    "StopRequest",
    "end_with_parent",
    "sigterm_raises",
    "sigterm_requests_a_stop",
]

EXIT_PREEMPTED = 128 + signal.SIGTERM  # 143: the shell's code for a process ended by SIGTERM
GRACE_SECONDS = 10.0  # a worker whose parent died gets this long to unwind after SIGTERM, then it is ended
POLL_SECONDS = 0.5  # how often the watching thread looks for the parent
PARENT_DYING_SECONDS = 0.5  # how long a SIGTERM's handler waits to tell a parent's death from a stop it sent
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


class Preempted(KeyboardInterrupt):
    """SIGTERM arrived (a scheduler preempting the job, torchrun stopping its workers, or this worker's launcher
    ending). A KeyboardInterrupt, so that what handles Ctrl-C handles it: fit's note says which save resumes."""

    def __init__(self, message: str = "stopped by SIGTERM"):
        super().__init__(message)


_parent: int | None = None  # the parent end_with_parent watches, to say why SIGTERM came
_watcher: int | None = None  # the process whose thread watches it (a forked child inherits _parent, not the thread)
_delivered = False  # a Preempted was raised since sigterm_raises began: later SIGTERMs are ignored
_parent_gone = False  # the watching thread found the parent dead and sent SIGTERM: a repeat of the kernel's (Linux)


def _raise_preempted(signum, frame) -> None:
    global _delivered
    if _delivered:
        return
    _delivered = True
    if _parent is not None and _parent_ended(_parent):
        raise Preempted(f"stopped by SIGTERM: its launcher (pid {_parent}) had ended")
    raise Preempted("stopped by SIGTERM (how a scheduler preempts a job, and how a launcher stops its workers)")


def _parent_dying() -> bool:
    """Whether the parent end_with_parent watches in this process has died or is dying (waits as _parent_ended)."""
    return _parent is not None and _watcher == os.getpid() and _parent_ended(_parent)


def _parent_ended(parent: int) -> bool:
    """Whether `parent` has died, given a moment: the kernel sends the parent-death signal when the *thread* that
    started this process exits, and a process killed outright loses its other threads a few milliseconds later (until
    then this process counts one of them as its parent)."""
    deadline = time.monotonic() + PARENT_DYING_SECONDS
    while os.getppid() == parent:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def catch_sigterm():
    """Make SIGTERM raise Preempted in the main thread; returns the handler it replaced, for restore_sigterm. Does
    nothing (returns None) outside the main thread, where Python cannot set handlers, where SIGTERM is ignored on
    purpose (SIG_IGN), or where a handler not set from Python (None: one that could not be put back) has it."""
    global _delivered
    if threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(signal.SIGTERM)
    if previous is None or previous == signal.SIG_IGN or previous is _raise_preempted:
        return None
    _delivered = False
    signal.signal(signal.SIGTERM, _raise_preempted)
    return previous


def restore_sigterm(previous) -> None:
    """Put back the handler catch_sigterm replaced (nothing if it replaced none)."""
    if previous is not None and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def sigterm_raises() -> Iterator[None]:
    """Within: SIGTERM raises Preempted in the main thread (see catch_sigterm); the previous handler comes back after."""
    previous = catch_sigterm()
    try:
        yield
    finally:
        restore_sigterm(previous)


class StopRequest:
    """What sigterm_requests_a_stop hands the loop: `asked` turns True at the first SIGTERM."""

    def __init__(self):
        self.asked = False

    def preempted(self) -> Preempted:
        """The error to raise once the loop has saved: a Preempted whose message says the stop was asked."""
        return Preempted("stopped by SIGTERM at the next safe point, after saving")


@contextlib.contextmanager
def sigterm_requests_a_stop() -> Iterator[StopRequest]:
    """Within: the first SIGTERM sets the request's `asked` and returns (the main thread carries on to a point where
    it can save and stop); a second raises Preempted at once. Outside the main thread, or where SIGTERM is ignored,
    nothing is installed and `asked` stays False. The previous handler comes back after."""
    request = StopRequest()

    def ask(signum, frame) -> None:
        # Once the parent end_with_parent watches has died, a SIGTERM is news of that death (the kernel's, the
        # watching thread's repeat), never a second request: the watcher's grace ends a process that does not stop.
        # The kernel sends its death signal as each of a dying launcher's threads exits, before this process is
        # re-parented: a parent still dying counts as gone (torchrun's agent killed outright, seen in CI 2026-11-29).
        if request.asked and not _parent_gone and not _parent_dying():
            raise Preempted("stopped by a second SIGTERM before the loop reached a point where it could save")
        request.asked = True

    installed = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM) if installed else None
    installed = installed and previous is not None and previous != signal.SIG_IGN
    if installed:
        signal.signal(signal.SIGTERM, ask)
    try:
        yield request
    finally:
        if installed:
            signal.signal(signal.SIGTERM, previous)


def end_with_parent(parent_pid: int | None = None, grace: float = GRACE_SECONDS) -> None:
    """End this process when its parent dies: SIGTERM at once (which sigterm_raises turns into Preempted), and
    os._exit(EXIT_PREEMPTED) if it is still alive `grace` seconds later (a main thread stuck in C code, such as a
    collective, never runs Python's handler). `parent_pid`: the parent expected; a process whose parent died before
    this call (it has another by now) is stopped at once. Once per process; later calls do nothing."""
    global _parent, _watcher
    if _watcher == os.getpid():
        return
    _parent, _watcher = (os.getppid() if parent_pid is None else parent_pid), os.getpid()
    _ask_kernel_for(signal.SIGTERM)  # after this, a parent's death cannot be missed
    threading.Thread(target=_watch, args=(_parent, grace), name="gpukit-end-with-parent", daemon=True).start()


def _ask_kernel_for(signum: int) -> bool:
    """Linux: the kernel sends `signum` to this process when the thread that started it exits."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(_PR_SET_PDEATHSIG, int(signum), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _watch(parent: int, grace: float) -> None:
    global _parent_gone
    while os.getppid() == parent:
        time.sleep(POLL_SECONDS)
    _parent_gone = True
    os.kill(os.getpid(), signal.SIGTERM)  # (on Linux the kernel has sent one already: the handler ignores a second)
    time.sleep(grace)
    os.write(
        2,
        f"gpukit: this process's launcher (pid {parent}) ended, and the process did not stop within {grace:g} s of "
        "SIGTERM; it was ended without cleaning up.\n".encode(),
    )
    os._exit(EXIT_PREEMPTED)
