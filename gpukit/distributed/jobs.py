"""Command-line jobs started from a notebook (torchrun, `python -m gpukit train`): wait for them, never hang."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Sequence


def wait_for_jobs(processes: Sequence[subprocess.Popen], timeout: float) -> list[tuple[str, str]]:
    """(stdout, stderr) of each process, once every one has ended; start them with stdout and stderr piped.

    If they have not all ended `timeout` seconds after this call, every one is stopped and TimeoutError says what
    each printed last: a job that hangs (a rendezvous nobody joins, a collective a dead rank never enters) ends the
    cell with its own output instead of leaving the cell running for ever.
    """
    deadline = time.monotonic() + timeout
    try:
        return [process.communicate(timeout=max(deadline - time.monotonic(), 0.01)) for process in processes]
    except subprocess.TimeoutExpired:
        for process in processes:
            process.kill()
        outputs = [process.communicate() for process in processes]
        printed = "\n".join(f"--- job {index}:\n{out[-2000:]}{err[-2000:]}" for index, (out, err) in enumerate(outputs))
        raise TimeoutError(
            f"{len(processes)} job(s) had not all ended after {timeout:g} s and were stopped; what they printed last "
            f"(look for a rank that failed or waits for the others):\n{printed}"
        ) from None
