"""A training run on disk: the JSON file `History.save` writes, which `History.load` and
`gk.plots.compare` read, and the environment recorded with it.

The file is one JSON object (Python's json module: floats round-trip exactly, NaN is written as NaN):

    {"format": "gpukit.History", "version": 1, "saved_at": "2026-…+00:00" (UTC),
     "environment": {"device", "device_name", "precision", "profile", "python", "torch", "cuda",
                     "gpukit", "git_commit"},
     "summary": {…},    the run's figures as History.summary() gave them when saved (for readers of the file)
     "history": {…}}    every other History field: steps, epochs, batch_size, sample_name, …

It lives below gpukit.train so that gpukit.plots can read saved runs without importing the trainer.
"""

from __future__ import annotations

import datetime
import functools
import importlib.metadata
import json
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from .env import detect, profile_for
from .files import write_atomic
from .validation import is_int

FORMAT = "gpukit.History"
VERSION = 1  # raise it when a change makes files unreadable by older gpukit versions


class HistoryFileError(ValueError):
    """A file is not a saved History, is damaged, or was written by a newer gpukit."""


def git_commit(folder: str | Path | None = None) -> str | None:
    """The commit checked out in the git repository holding `folder` (default: the current folder);
    None outside a repository or before its first commit.

    Read from the repository's files (HEAD, then the branch's loose ref or packed-refs): fit records it on every
    call, and a `git rev-parse` child process took 10-15 ms of a first step that should take a few. Where the files
    do not tell (GIT_DIR set, the reftable format, a ref that points to a ref), git itself is asked, once per folder
    and process; then None also where git is not installed."""
    start = Path(folder if folder is not None else ".").resolve()
    found = _commit_from_files(start)
    if found is not _UNKNOWN:
        return found
    if start not in _asked_git:
        _asked_git[start] = _commit_from_git(start)
    return _asked_git[start]


_UNKNOWN = object()  # the repository's files did not tell: ask git
_asked_git: dict[Path, str | None] = {}  # folder → what git rev-parse answered, once per process
_HASH = re.compile(r"[0-9a-f]{40}([0-9a-f]{24})?")  # SHA-1, or SHA-256 in repositories that use it


def _git_folder(start: Path) -> Path | None:
    """The .git folder of the repository holding `start` (a worktree's .git file points to its own)."""
    for folder in (start, *start.parents):
        dot_git = folder / ".git"
        if dot_git.is_dir():
            return dot_git
        if dot_git.is_file():
            text = dot_git.read_text(errors="replace").strip()
            return (folder / text.removeprefix("gitdir:").strip()).resolve() if text.startswith("gitdir:") else None
    return None


def _commit_from_files(start: Path):
    """The commit HEAD names, read from the files; None (no repository, no commit yet) or _UNKNOWN."""
    if "GIT_DIR" in os.environ or "GIT_WORK_TREE" in os.environ:
        return _UNKNOWN
    try:
        git_folder = _git_folder(start) if start.is_dir() else None
        if git_folder is None:
            return None
        head = (git_folder / "HEAD").read_text().strip()
        if _HASH.fullmatch(head):  # a detached HEAD
            return head
        common = git_folder
        if (git_folder / "commondir").is_file():  # a linked worktree: branches live in the main repository
            common = (git_folder / (git_folder / "commondir").read_text().strip()).resolve()
        if not head.startswith("ref: refs/") or (common / "reftable").exists():
            return _UNKNOWN
        ref = head.removeprefix("ref: ")
        loose = common / ref
        if loose.is_file():
            commit = loose.read_text().strip()
            return commit if _HASH.fullmatch(commit) else _UNKNOWN
        packed = common / "packed-refs"
        if packed.is_file():
            for line in packed.read_text().splitlines():
                if line.endswith(" " + ref) and _HASH.fullmatch(line.split(" ", 1)[0]):
                    return line.split(" ", 1)[0]
        return None  # a branch with no commit yet
    except OSError:
        return _UNKNOWN


def _commit_from_git(folder: Path) -> str | None:
    try:
        result = subprocess.run(
            ["git", "rev-parse", "--verify", "--quiet", "HEAD"],
            cwd=folder,
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.SubprocessError):  # no git on PATH, a folder that is gone, a hung git
        return None
    commit = result.stdout.strip()
    return commit if result.returncode == 0 and commit else None


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as file:  # Linux: platform.processor() often says only "x86_64"
            for line in file:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


def device_name(device: torch.device | None) -> str | None:
    if device is None:
        return None
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    if device.type == "mps":
        return f"Apple GPU (MPS) on {platform.machine()}"
    return _cpu_name()


@functools.cache  # parsing the package's metadata took 9 ms, on every fit
def _gpukit_version() -> str | None:
    try:
        return importlib.metadata.version("gpukit")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return None


def run_environment(device: torch.device | None) -> dict:
    """What a run ran on, recorded by fit and saved with its History (device None: no device name).

    The profile is the one for work on `device` (gk.env.profile_for: no survey of the GPUs, so that a fit on the
    CPU starts no child process), and gk.detect()'s choice for this machine where no device is given."""
    return {
        "device_name": device_name(device),
        "profile": (profile_for(device) if device is not None else detect().profile).name,  # tiny, cpu or gpu
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,  # None for a CPU-only build of torch
        "gpukit": _gpukit_version(),
        "git_commit": git_commit(),
    }


def _plain(value):
    """JSON's fallback for numbers that are not Python's own (NumPy scalars, 0-d tensors)."""
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"a History column holds a {type(value).__name__}, which JSON cannot store; use numbers or None.")


def _parse(path: Path):
    """The JSON in `path`, or HistoryFileError. A file that does not start with "{" is not read
    further: a large binary file (a checkpoint, a dataset) is not loaded into memory to find out."""
    not_history = f"{path} is not a saved History (History.load reads the JSON files History.save writes)"
    with open(path, "rb") as file:
        if not file.read(256).lstrip().startswith(b"{"):
            raise HistoryFileError(f"{not_history}: it is not a JSON object (it does not start with '{{').")
        file.seek(0)
        try:
            return json.loads(file.read().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise HistoryFileError(f"{not_history}: it is not JSON ({error}).") from error


def _is_saved_history(path: Path) -> bool:
    try:
        record = _parse(path)
    except (OSError, HistoryFileError):
        return False
    return isinstance(record, dict) and record.get("format") == FORMAT


def write(path: str | Path, environment: dict, summary: dict, history: dict) -> Path:
    """Write a run to `path` atomically (the folder is created). A file already at `path` is
    replaced only if it is a saved History: anything else is left untouched and refused."""
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a folder; give History.save a file path such as {path / 'run.json'}.")
    if path.exists() and not _is_saved_history(path):
        raise FileExistsError(
            f"{path} exists and is not a saved History, so History.save will not overwrite it; choose another "
            "path (e.g. runs/name.json), or delete the file first if you no longer need it."
        )
    record = {
        "format": FORMAT,
        "version": VERSION,
        "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "environment": environment,
        "summary": summary,
        "history": history,
    }
    text = json.dumps(record, indent=1, default=_plain) + "\n"  # before writing: an error leaves no file
    write_atomic(path, text.encode("utf-8"))
    return path


def read(path: str | Path) -> dict:
    """The record `write` wrote, checked: a clear HistoryFileError for anything else."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"no saved History at {path}: check the path (History.save wrote it where you said).")
    if path.is_dir():
        inside = sorted(child.name for child in path.glob("*.json"))[:5]
        raise IsADirectoryError(
            f"{path} is a folder, not a saved History: pass the JSON file History.save wrote"
            + (f" (it holds {', '.join(inside)})." if inside else f", e.g. {path / 'run.json'}.")
        )
    record = _parse(path)
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise HistoryFileError(
            f"{path} is not a saved History (History.load reads the JSON files History.save writes): it has no "
            f'"format": "{FORMAT}" entry.'
        )
    version = record.get("version")
    if not is_int(version) or version < 1:
        raise HistoryFileError(f"{path} is damaged: its format version is {version!r}, not a positive integer.")
    if version > VERSION:
        raise HistoryFileError(
            f"{path} was saved by a newer gpukit (History format {version}; gpukit {_gpukit_version()} "
            f"reads formats up to {VERSION}): upgrade gpukit (pip install -U gpukit) to load it."
        )
    history = record.get("history")
    if (
        not isinstance(history, dict)
        or not isinstance(history.get("steps"), list)
        or not isinstance(history.get("epochs"), list)
        or not isinstance(record.get("environment"), dict)
        or not isinstance(record.get("summary"), dict)
    ):
        raise HistoryFileError(
            f"{path} is damaged: a saved History holds environment, summary and history (with steps and epochs) "
            "entries; save the run again."
        )
    problem = _wrong_columns(history)
    if problem:
        raise HistoryFileError(f"{path} is damaged: {problem}; save the run again, or fix the file by hand.")
    return record


_NUMBER_FIELDS = {"micro_batch_size": int, "global_batch_size": int, "batch_size": int, "skipped_steps": int}
_STEP_COLUMNS = ("loss", "step_time", "samples_per_second")  # what History.summary and gk.plots.compare read


def _is_number(value, kind=(int, float)) -> bool:
    return isinstance(value, kind) and not isinstance(value, bool)


def _wrong_columns(history: dict) -> str | None:
    """What in a saved History's rows and fields is not what History.summary and gk.plots.compare read, in words:
    every row a dict; steps with an integer step and numeric loss, step_time and samples_per_second; epochs with an
    integer epoch and numbers (or null) in their train_ and eval_ columns."""
    for name, kind in _NUMBER_FIELDS.items():
        if name in history and not _is_number(history[name], kind):
            return f"its {name} is {history[name]!r}, not an integer"
    if "seconds" in history and not _is_number(history["seconds"]):
        return f"its seconds is {history['seconds']!r}, not a number"
    if "sample_name" in history and not isinstance(history["sample_name"], str):
        return f"its sample_name is {history['sample_name']!r}, not a string"
    for table, index_column in (("steps", "step"), ("epochs", "epoch")):
        for number, row in enumerate(history[table], 1):
            if not isinstance(row, dict):
                return f"{table} row {number} is {row!r:.60}, not an object of columns"
            numeric = _STEP_COLUMNS if table == "steps" else [c for c in row if c.startswith(("train_", "eval_"))]
            for column in (index_column, *numeric):
                if column not in row:
                    return f"{table} row {number} has no {column!r} column"
                value, kind = row[column], int if column == index_column else (int, float)
                if not _is_number(value, kind) and not (value is None and column != index_column and table == "epochs"):
                    expected = "an integer" if kind is int else "a number"
                    return f"{table} row {number} has {column}={value!r:.60}, not {expected}"
    return None
