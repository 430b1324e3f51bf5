"""`fit(log_dir=...)`: History's rows as TensorBoard scalars, written as fit logs them.

Tags are History's own column names: `steps/<column>` at the optimizer step (loss, lr, lr_group1, ..., step_time,
samples_per_second, tokens_per_second for sequences) and `epochs/<column>` at the epoch number
(train_loss, eval_accuracy, your metrics, peak_memory where measured, seconds, and any numeric
column added later, such as energy). The rows hold host numbers already, so writing them never
waits for the device; TensorBoard's writer does the file I/O on its own thread.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

EXTRA = "log"  # pip install 'gpukit[log]' installs tensorboard


class TensorBoardLog:
    """Writes History rows to a TensorBoard event file in `log_dir` (one folder per run)."""

    def __init__(self, log_dir: str | Path):
        self.log_dir = Path(log_dir)
        check_log_folder(self.log_dir)
        self.writer = _summary_writer()(log_dir=str(self.log_dir))

    def add_step(self, row: dict) -> None:
        self._add("steps", row, row["step"], skip=("step", "epoch"))

    def add_epoch(self, row: dict) -> None:
        self._add("epochs", row, row["epoch"], skip=("epoch",))
        self.writer.flush()  # so that a TensorBoard watching the folder shows each epoch as it ends

    def _add(self, group: str, row: dict, step: int, skip: tuple[str, ...]) -> None:
        for column, value in row.items():
            if column not in skip and _is_number(value):
                self.writer.add_scalar(f"{group}/{column}", value, global_step=step)

    def close(self) -> None:
        self.writer.close()


class NoLog:
    """What fit uses without log_dir: writes nothing."""

    def add_step(self, row: dict) -> None:
        pass

    def add_epoch(self, row: dict) -> None:
        pass

    def close(self) -> None:
        pass


def open_log(log_dir: str | Path | None) -> TensorBoardLog | NoLog:
    return TensorBoardLog(check_log_dir(log_dir)) if log_dir is not None else NoLog()


def check_log_folder(log_dir) -> None:
    """Before fit builds or moves anything: log_dir names a folder that can be written (made if missing), and the
    tensorboard package that writes into it is installed."""
    if check_log_dir(log_dir) is None:
        return
    _summary_writer()
    _check_writable(Path(log_dir))


def _summary_writer() -> type:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as error:
        raise ImportError(
            f"fit(log_dir=...) writes TensorBoard logs, which needs the tensorboard package: "
            f"pip install 'gpukit[{EXTRA}]' (or pip install tensorboard), or leave log_dir out."
        ) from error
    return SummaryWriter


def check_log_dir(log_dir):
    """`log_dir` if it names a folder (a str or path, not empty); a TypeError (not a path) or ValueError (an empty
    one) naming it otherwise. Path() would raise a bare TypeError for log_dir=3, and take log_dir="" for the current
    folder, filling it with event files."""
    if log_dir is None:
        return None
    if not isinstance(log_dir, (str, os.PathLike)):
        raise TypeError(
            f"log_dir must be a folder path (a str or Path) for TensorBoard's files, got {log_dir!r} (a "
            f"{type(log_dir).__name__}); e.g. log_dir='runs/my_run', or leave it out."
        )
    if not str(os.fspath(log_dir)).strip():
        raise ValueError(
            f"log_dir={os.fspath(log_dir)!r} names no folder (TensorBoard would fill the current folder with its "
            "files); pass a folder path such as log_dir='runs/my_run', or leave it out."
        )
    return log_dir


def _is_number(value) -> bool:
    """A column TensorBoard can plot: a number (None, text and flags are left out)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_writable(log_dir: Path) -> None:
    """Fail before training, with what to do, rather than in TensorBoard's writer thread mid-run."""
    if log_dir.exists() and not log_dir.is_dir():
        raise ValueError(f"log_dir={str(log_dir)!r} is a file; TensorBoard writes into a folder: pass a folder path.")
    try:
        log_dir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=log_dir):
            pass
    except OSError as error:
        raise ValueError(
            f"log_dir={str(log_dir)!r} cannot be written to ({error.strerror or error}); pass a folder you can "
            "write to, e.g. log_dir='runs/my_run'."
        ) from error
