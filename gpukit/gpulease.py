"""`gpu-check --budget SECONDS` and `gpu-check --collect DIR`: a short lease's check, which a cut cannot erase.

gpukit/gpuledger.py plans; this runs the plan. On a lent GPU machine (tools/gpu_lease.sh) the check:
1. plans what the ledger says is due, packed into what is left of SECONDS once its own start, pre-flight and
   writing are taken off (OWN_SECONDS), so that the whole command ends within SECONDS;
2. checks, before the first item, what decides whether the rest is worth it (`preflight`): torch and its CUDA
   build, a GPU torch can use (name, memory), nbval and ipykernel if a lesson is planned, torchao if an FP8 item is,
   and the commit it will record. Anything missing stops it at once with one line (EXIT_NOT_READY);
3. runs each item under the smaller of what is left and its overrun limit (`item_cap`), and as each item ends
   writes to --out DIR its result line (summary.txt), the section for RESULTS.md (results.md), the ledger
   (gpu-ledger.json) and every log so far (logs.tar.gz), each replaced whole: a cut at any second keeps every
   finished item, and at most 6 files come back (the device returns 8);
4. on SIGTERM, SIGHUP or SIGINT stops the running item with every process it started (items run in sessions of
   their own, so the signal does not reach them by itself), records it as cut, writes, and exits 128 + the signal.
   Where the check itself is killed (SIGKILL), each item's first process dies with it (PR_SET_PDEATHSIG, set by
   gpucheck.run_command on Linux).
Back here, `--collect DIR` checks DIR's ledger and section before it changes anything, then merges them: the
ledger item by item (the later update wins), the section in place of the same run's, so that collecting a cut run
and later the same folder again changes RESULTS.md once. Without --out, the check writes to its log folder and
collects it itself at the end.

The commit recorded: git's, where the checkout has a usable .git. The device's copy has none (the device tool
sends tracked and untracked-but-not-ignored files, and carried paths), so `bash tools/gpu_lease.sh prepare` writes
LEASE_FILE here before the call: the commit, the files that differ from it, what changed since each commit the
ledger names, and a digest of the files that travel, which the check recomputes there. An item whose files differ
from the commit is recorded at commit "unknown", which every later plan counts as changed: it stays due.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import hashlib
import json
import math
import re
import signal
import subprocess
import sys
import tarfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import gpucheck, gpuledger
from .gpucheck import StepResult
from .gpuledger import LEDGER_PATH, UNKNOWN, Plan
from .runfile import git_commit

LEASE_FILE = ".whl/lease.json"  # written here by tools/gpu_lease.sh prepare; .whl/ is git-ignored and carried
# Seconds of the check's own, taken off --budget before items are packed (the dry run plans with them too). Read
# from an H100 lease's log and this machine: Python and torch start in 5-10 s, planning takes a few, the pre-flight
# child imports torch, initialises CUDA and imports torchao and nbval (10-20 s), the last writing takes 1-2 s.
OWN_SECONDS = {"start and plan": 15, "pre-flight": 25, "writing": 5}
PREFLIGHT_SECONDS = 120  # the pre-flight child's own time limit
# An item is stopped after twice its planned seconds, or 2 minutes more than planned where that is longer (a short
# estimate that never met a GPU, a cold compilation): one wrong estimate cannot eat the lease, and a cut gives the
# next plan a lower bound.
OVERRUN, OVERRUN_SECONDS = 2.0, 120
ITEM_LIMITS = {
    "tests": gpucheck.TESTS_SECONDS,
    "lesson": gpucheck.LESSON_SECONDS,
    "benchmark": gpucheck.BENCHMARK_SECONDS,
}
OUT_FILE_BYTES = 15 * 2**20  # the device returns files of 16 MiB at most
OUT_FILES = ("preflight.txt", "summary.txt", "results.md", "gpu-ledger.json", "logs.tar.gz")  # what --out receives
EXIT_NOT_READY = 5  # the pre-flight found something missing: nothing was run
NEEDS_TORCHAO = re.compile(r"\btorchao\b|\b(?:gk|gpukit)\.fp8\b|from gpukit import[^\n]*\bfp8\b")
MARKER = "<!-- gpu-check run {} -->"
END_MARKER = "<!-- end of gpu-check run {} -->"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # SIGINT already raises KeyboardInterrupt


def item_cap(planned: int) -> float:
    """Seconds after which an item planned for `planned` seconds is stopped (see OVERRUN)."""
    return max(OVERRUN * planned, planned + OVERRUN_SECONDS)


def own_seconds() -> int:
    return sum(OWN_SECONDS.values())


def check_budget(budget: float, leases: int = 1) -> None:
    """A ValueError, before any work, unless `budget` is a finite number of seconds above the check's own."""
    if not math.isfinite(budget) or budget <= own_seconds():
        raise ValueError(
            f"gpu-check --budget must be a number of seconds above {own_seconds()} (the check's own start, pre-flight "
            f"and writing), got {budget}: give the lease's seconds, e.g. --budget 480."
        )
    if leases < 1:
        raise ValueError(f"gpu-check --leases must be 1 or more, got {leases}.")


# ---------------------------------------------------------------------------------------------
# The commit to record: from git, or from the lease file written here before the call


@dataclass
class Identity:
    commit: str  # 12 hex digits
    changed: set[str]  # files of this tree that differ from `commit` (uncommitted, or untracked)
    changes: dict[str, set[str] | None]  # {commit the ledger names: files changed since it, None if unknown here}
    source: str  # where this comes from, for the pre-flight line

    def commit_for(self, deps: list[str]) -> str:
        """The commit an item with these files ran at: UNKNOWN where one of them differs from it."""
        return UNKNOWN if self.changed & set(deps) else self.commit


def _git(root: Path, *args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def uncommitted_files(root: Path) -> set[str] | None:
    """Files that differ from HEAD or that git does not track (but does not ignore); None where git cannot tell."""
    out = _git(root, "status", "--porcelain=v1", "-z", "--untracked-files=all")
    if out is None:
        return None
    fields, files = out.split("\0"), set()
    while fields:
        entry = fields.pop(0)
        if len(entry) > 3:
            files.add(entry[3:])
            if entry[0] in "RC" and fields:  # a rename or copy: its source path follows
                files.add(fields.pop(0))
    return files


def identity_from_git(root: Path, ledger: dict) -> Identity | None:
    head, changed = git_commit(root), uncommitted_files(root)
    if head is None or changed is None:
        return None
    return Identity(head[:12], changed, gpuledger.changes_by_commit(root, ledger, head), "git")


def travelling_files(root: Path) -> list[str]:
    """What the device tool sends: tracked files and untracked ones git does not ignore, that exist."""
    out = _git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard") or ""
    return sorted({path for path in out.split("\0") if path and (root / path).is_file()})


def tree_digest(root: Path, files: list[str]) -> str:
    """sha256 over each file's path and contents: the same on the device only if every file came as it was."""
    digest = hashlib.sha256()
    for path in sorted(files):
        contents = (root / path).read_bytes() if (root / path).is_file() else b"(missing)"
        digest.update(f"{path}\0{hashlib.sha256(contents).hexdigest()}\n".encode())
    return digest.hexdigest()


def write_lease_file(root: Path) -> Path:
    """LEASE_FILE, here, before a lease: the commit and what the device's copy cannot ask git (see the docstring)."""
    ledger = gpuledger.load_ledger(root / LEDGER_PATH)
    identity = identity_from_git(root, ledger)
    if identity is None:
        raise ValueError(f"{root} is no git checkout git can read: the lease file needs its commit.")
    files = travelling_files(root)
    content = {
        "commit": identity.commit,
        "changed": sorted(identity.changed),
        "changes": {commit: None if files_ is None else sorted(files_) for commit, files_ in identity.changes.items()},
        "files": files,
        "digest": tree_digest(root, files),
        "written": gpuledger.now(),
    }
    path = root / LEASE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(content, indent=1) + "\n")
    return path


def identity_from_lease_file(root: Path) -> Identity:
    """The identity LEASE_FILE records; a ValueError if it is damaged or describes other files than these."""
    path = root / LEASE_FILE
    try:
        content = json.loads(path.read_text())
        files, commit = content["files"], content["commit"]
        changes = {key: None if value is None else set(value) for key, value in content["changes"].items()}
        changed, written, digest = set(content["changed"]), content["written"], content["digest"]
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(
            f"{LEASE_FILE} cannot be read ({error!r}): run bash tools/gpu_lease.sh prepare again."
        ) from None
    if tree_digest(root, files) != digest:
        raise ValueError(
            f"{LEASE_FILE} (written {written}) describes other files than this copy's: run "
            "bash tools/gpu_lease.sh prepare again just before the call."
        )
    return Identity(commit, changed, changes, f"{LEASE_FILE}, written {written}")


def find_identity(root: Path, ledger: dict) -> Identity:
    """git's identity where the checkout has a usable .git, else the lease file's; a ValueError if neither."""
    identity = identity_from_git(root, ledger)
    if identity is not None:
        return identity
    if not (root / LEASE_FILE).is_file():
        raise ValueError(
            f"no commit to record: {root} has no usable .git and no {LEASE_FILE}; run bash tools/gpu_lease.sh "
            "prepare in the checkout before the call (it writes the commit there)."
        )
    return identity_from_lease_file(root)


# ---------------------------------------------------------------------------------------------
# The pre-flight: before the first item, in a child process (this one must not hold a CUDA context)


PREFLIGHT_SCRIPT = r"""
import importlib, importlib.metadata, json, torch
facts = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
if facts["cuda_available"]:
    gpu = torch.cuda.get_device_properties(0)
    facts.update(gpu=gpu.name, gpu_memory=gpu.total_memory)
for name, modules in {"nbval": ["nbval.plugin", "ipykernel.kernelapp"], "torchao": ["torchao.float8"]}.items():
    try:
        for module in modules:
            importlib.import_module(module)
        facts[name] = importlib.metadata.version(name)
    except Exception as error:
        facts[name] = None
        facts[name + "_error"] = f"{type(error).__name__}: {error}"
print("PREFLIGHT " + json.dumps(facts))
"""


def preflight_facts(root: Path, logs: Path) -> dict:
    """What the items' environment has, from a child process started as they are ({} if it said nothing)."""
    log = logs / "preflight.log"
    gpucheck.run_command(
        [sys.executable, "-c", PREFLIGHT_SCRIPT],
        cwd=root,
        environment=gpucheck.child_environment(root, GPUKIT_PROFILE="gpu"),
        seconds=PREFLIGHT_SECONDS,
        log=log,
    )
    lines = [line for line in log.read_text(errors="replace").splitlines() if line.startswith("PREFLIGHT ")]
    return json.loads(lines[-1].removeprefix("PREFLIGHT ")) if lines else {"error": gpucheck.last_line(log)}


def preflight_lines(facts: dict, identity: Identity, needs: set[str]) -> tuple[list[str], str | None]:
    """(a line per fact, the first thing missing or None). `needs`: of "nbval", "torchao", what the plan needs."""
    if "torch" not in facts:
        return [], f"the pre-flight child failed: {facts.get('error')}"
    lines = [f"torch {facts['torch']}, built for CUDA {facts['cuda_build']}"]
    problem = None if facts["cuda_build"] else f"torch {facts['torch']} is a CPU-only build"
    if facts["cuda_available"]:
        lines.append(f"GPU: {facts['gpu']}, {facts['gpu_memory'] / 2**30:.1f} GiB")
    problem = problem or (None if facts["cuda_available"] else "torch sees no CUDA GPU in the items' environment")
    for name in ("nbval", "torchao"):
        found = facts.get(name)
        lines.append(f"{name}: {found or facts.get(name + '_error')}" + ("" if name in needs else " (not needed)"))
        if name in needs and not found:
            problem = problem or f"{name} does not import ({facts.get(name + '_error')}): carry its wheels (.whl)"
    changed = f"; {len(identity.changed)} files differ from it" if identity.changed else ""
    lines.append(f"commit {identity.commit} ({identity.source}{changed})")
    return lines, problem


def needs(root: Path, plan: Plan) -> set[str]:
    """What the planned items need beyond torch: "nbval" for a lesson, "torchao" for an FP8 one."""
    kinds = {gpuledger.item_kind(candidate.item) for candidate in plan.chosen}
    fp8 = any(NEEDS_TORCHAO.search(gpuledger.python_source(root / c.item)) for c in plan.chosen)
    return {name for name, needed in (("nbval", "lesson" in kinds), ("torchao", fp8)) if needed}


# ---------------------------------------------------------------------------------------------
# --out DIR: written whole after each item


@contextlib.contextmanager
def signals_held():
    """Hold SIGTERM, SIGHUP and SIGINT until the block ends: a file is never left half-replaced by our own stop."""
    held = {*STOP_SIGNALS, signal.SIGINT}
    signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def replace_file(path: Path, write) -> None:
    """`write(temporary path)`, then the temporary file renamed over `path`: `path` is whole, old or new."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    temporary.replace(path)


@dataclass
class Run:
    """One budgeted check: what it writes into `out` after each item."""

    run_id: str  # the time it started: marks its section in RESULTS.md
    root: Path
    machine: gpucheck.Machine
    plan: Plan
    budget: float
    out: Path
    logs: Path
    ledger: dict
    results: list[StepResult] = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)

    def identity(self, commit: str) -> dict:
        """What the ledger records of a run that ends now: {"gpu", "torch", "commit", "date"}."""
        return {"gpu": self.machine.gpu, "torch": self.machine.torch, "commit": commit, "date": gpuledger.now()}

    def section(self, finished: bool) -> str:
        seconds = time.monotonic() - self.started
        body = gpucheck.results_section(self.machine, self.results, seconds, f"gpu-check --budget {self.budget:.0f}")
        ran = {result.name for result in self.results}
        rest = [gpuledger.item_name(c.item) for c in self.plan.chosen if gpuledger.item_name(c.item) not in ran]
        cut = (
            ""
            if finished or not rest
            else f"\nCut: the check stopped before {', '.join(rest)} (written after {len(self.results)} items).\n"
        )
        return f"{MARKER.format(self.run_id)}\n{body}{cut}{END_MARKER.format(self.run_id)}\n"

    def write(self, finished: bool = False) -> None:
        """Every OUT_FILES but the pre-flight's, replaced whole (a second or so: the logs are compressed anew)."""
        seconds = time.monotonic() - self.started
        summary = gpucheck.summary(self.machine, self.results, seconds, None, self.logs)
        with signals_held():
            self.out.mkdir(parents=True, exist_ok=True)
            replace_file(self.out / "results.md", lambda path: path.write_text(self.section(finished)))
            replace_file(self.out / "summary.txt", lambda path: path.write_text(summary + "\n"))
            gpuledger.save_ledger(self.out / "gpu-ledger.json", self.ledger)  # replaced whole too
            if self.out != self.logs:  # without --out the logs are already beside the files
                replace_file(self.out / "logs.tar.gz", functools.partial(_archive, self.logs))


def _archive(logs: Path, path: Path) -> None:
    """The logs folder as a .tar.gz; without the executed lessons (notebooks/, figures and all) where they would
    take it past what comes back from the device (16 MiB a file)."""
    for keep_lessons in (True, False):
        with tarfile.open(path, "w:gz") as archive:
            archive.add(logs, arcname=logs.name, filter=None if keep_lessons else _no_lessons)
        if path.stat().st_size <= OUT_FILE_BYTES:
            return


def _no_lessons(member: tarfile.TarInfo) -> tarfile.TarInfo | None:
    return None if "/notebooks/" in member.name + "/" else member


# ---------------------------------------------------------------------------------------------
# Running the plan


class Stopped(KeyboardInterrupt):
    """The check was sent SIGTERM or SIGHUP (the lease's deadline, a closed terminal): stopped as by Ctrl-C."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum, frame):
    raise Stopped(signum)


@contextlib.contextmanager
def stopped_by_signals():
    """SIGTERM and SIGHUP raise Stopped here (gpucheck.run_command then stops the running item's process group)."""
    previous = {sig: signal.signal(sig, _raise_stopped) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def run_item(root: Path, logs: Path, item: str, limit: float) -> StepResult:
    kind = gpuledger.item_kind(item)
    if kind == "tests":
        return gpucheck.run_tests(root, logs, limit, files=[item])
    if kind == "lesson":
        return gpucheck.run_lesson(root, logs, root / item, limit)
    return gpucheck.run_benchmark(root, logs, root / item, limit)


def _run_one(run: Run, candidate, deadline: float, identity: Identity, deps: Mapping) -> StepResult:
    """Run one planned item (or say why not) and record it in the ledger: see run_plan."""
    kind, name = gpuledger.item_kind(candidate.item), gpuledger.item_name(candidate.item)
    left = deadline - time.monotonic()
    if candidate.seconds > left:
        return StepResult(kind, name, "not started", 0.0, f"{candidate.seconds} s planned, {left:.0f} s were left")
    cap = item_cap(candidate.seconds)
    limit = min(left, ITEM_LIMITS[kind], cap)
    commit, started = identity.commit_for(deps[candidate.item]), time.monotonic()
    try:
        result = run_item(run.root, run.logs, candidate.item, limit)
    except KeyboardInterrupt as stop:  # Stopped too: the item's processes are gone (run_command stopped them)
        seconds, why = time.monotonic() - started, f"the check was stopped ({stop.args[0] if stop.args else 'SIGINT'})"
        gpuledger.record_cut(run.ledger, candidate.item, seconds, why, run.identity(commit))
        run.results.append(StepResult(kind, name, "timeout", seconds, f"{why} after {seconds:.0f} s"))
        raise
    if result.status == "timeout" and limit < ITEM_LIMITS[kind]:  # cut by the lease, not by its own limit
        why = "the lease's time ran out" if limit < cap else f"its overrun limit ({candidate.seconds} s planned)"
        gpuledger.record_cut(run.ledger, candidate.item, result.seconds, f"stopped at {why}", run.identity(commit))
        result.detail = f"cut at {why} ({limit:.0f} s); {result.detail}"
        return result
    deps_ = deps[candidate.item]
    gpuledger.record(
        run.ledger, candidate.item, result.status, result.seconds, result.detail, run.identity(commit), deps_
    )
    return result


def run_plan(run: Run, identity: Identity, deps: Mapping, deadline: float, report=print) -> list[StepResult]:
    """Run `run.plan.chosen` in order, each started only if its planned seconds fit in what is left before
    `deadline` (an earlier one may have run over its plan), each under the smaller of what is left, its kind's own
    limit and item_cap; record each in the ledger and write --out as each ends."""
    run.write()  # a cut before the first item ends still leaves the section's head and the plan's ledger
    for candidate in run.plan.chosen:
        try:
            run.results.append(_run_one(run, candidate, deadline, identity, deps))
        finally:  # a stopped item too is written, as cut
            run.write()
        report(gpucheck.summary_row(run.results[-1]))  # after the writing: a line printed is an item kept
    return run.results


# ---------------------------------------------------------------------------------------------
# The command


def _dry_run(root: Path, ledger: dict, deps: Mapping, budget: float, leases: int, gpu: str) -> int:
    try:
        changes, note = find_identity(root, ledger).changes, None
    except ValueError as error:
        changes, note = {}, f"note: {error} Every recorded run counts as changed here."
    machine = {"gpu": gpu, "torch": "planned", "date": gpuledger.now()}
    plans = gpuledger.plan_leases(ledger, deps, changes, budget - own_seconds(), leases, lambda lease: machine)
    print(gpuledger.format_plans(plans, gpu, budget) + (f"\n{note}" if note else ""))
    return 0


def _preflight(root: Path, logs: Path, out: Path, plan: Plan, identity: Identity) -> str | None:
    """Print and write (out/preflight.txt) the pre-flight's lines; the first thing missing, or None."""
    lines, problem = preflight_lines(preflight_facts(root, logs), identity, needs(root, plan))
    lines += [f"stopped: {problem}"] if problem else []
    text = "\n".join(f"pre-flight: {line}" for line in lines)
    print(text, flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "preflight.txt").write_text(text + "\n")
    return problem


def _start(root: Path, ledger: dict, deps: Mapping, deadline: float, log_dir: Path | None) -> tuple:
    """The identity, machine, logs folder and plan of a budgeted check on this GPU."""
    identity = find_identity(root, ledger)
    machine = gpucheck.describe_machine(root)
    machine.commit = identity.commit
    logs = log_dir or root / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    left = deadline - time.monotonic() - OWN_SECONDS["pre-flight"] - OWN_SECONDS["writing"]
    plan = gpuledger.pack(gpuledger.candidates(ledger, deps, identity.changes, gpu=machine.gpu), max(left, 0))
    return identity, machine, logs, plan


def run_budget_check(
    budget: float,
    *,
    only=None,
    leases: int = 1,
    dry_run: bool = False,
    out: Path | None = None,
    log_dir: Path | None = None,
    results_path: Path | None = None,
    gpu: str = "NVIDIA H100 80GB HBM3",
) -> int:
    """gpu-check --budget: plan from the ledger and run the plan within `budget` seconds in all (or, `dry_run`,
    print `leases` plans for `gpu`, running nothing, GPU or not), as the module's docstring says. Without `out`,
    the files go to the log folder and are collected into `results_path` (default benchmarks/RESULTS.md) and the
    ledger at the end. Returns gpucheck's exit codes, EXIT_NOT_READY, or 128 + the signal that stopped it."""
    deadline = time.monotonic() + budget
    check_budget(budget, leases)
    root = gpucheck.repository_root()
    ledger = gpuledger.load_ledger(root / LEDGER_PATH)
    items = gpuledger.selected_items(root, only)
    message = None if dry_run else gpucheck.no_gpu_message()
    if message:  # before the items' files are read (seconds): nothing is run anyway
        print(message, file=sys.stderr)
        return gpucheck.EXIT_NO_GPU
    deps = {item: gpuledger.dependencies(root, item) for item in items}
    if dry_run:
        return _dry_run(root, ledger, deps, budget, leases, gpu)
    with stopped_by_signals():
        try:
            identity, machine, logs, plan = _start(root, ledger, deps, deadline, log_dir)
        except ValueError as error:  # no commit to record
            print(f"gpu-check: {error} Nothing was run.", file=sys.stderr)
            return EXIT_NOT_READY
        print(gpuledger.format_plans([plan], machine.gpu, budget), flush=True)
        problem = _preflight(root, logs, out or logs, plan, identity)
        if problem:
            print(f"gpu-check: {problem}. Nothing was run.", file=sys.stderr)
            return EXIT_NOT_READY
        run = Run(gpuledger.now(), root, machine, plan, budget, out or logs, logs, ledger, started=deadline - budget)
        try:
            run_plan(run, identity, deps, deadline - OWN_SECONDS["writing"], functools.partial(print, flush=True))
            code = gpucheck.exit_code(run.results)
        except KeyboardInterrupt as stop:
            code = 128 + getattr(stop, "signum", signal.SIGINT)
        run.write(finished=code < 128)
    print("\n" + gpucheck.summary(machine, run.results, time.monotonic() - run.started, None, logs))
    if out is None:
        collect(logs, results_path)
    return code


# ---------------------------------------------------------------------------------------------
# --collect DIR


def read_out_folder(folder: Path) -> tuple[str, dict]:
    """(results.md, the ledger) of a --out folder, both checked: FileNotFoundError or ValueError, naming what."""
    if not folder.is_dir():
        raise FileNotFoundError(f"gpu-check --collect: {folder} is no folder; give the one --out named ($OUT).")
    missing = [name for name in ("results.md", "gpu-ledger.json") if not (folder / name).is_file()]
    if missing:
        preflight = folder / "preflight.txt"
        why = f" ({gpucheck.last_line(preflight)})" if preflight.is_file() else ""
        raise FileNotFoundError(
            f"gpu-check --collect: {folder} has no {', '.join(missing)}: the check stopped before its first item"
            f"{why}, or this is not the folder `gpu-check --budget … --out DIR` wrote (tools/gpu_lease.sh: $OUT)."
        )
    try:
        incoming = gpuledger.load_ledger(folder / "gpu-ledger.json")
    except ValueError as error:
        raise ValueError(f"gpu-check --collect: {error}") from None
    section = (folder / "results.md").read_text(errors="replace")
    run_id = section_id(section)
    if run_id is None or not section.rstrip().endswith(END_MARKER.format(run_id)):
        raise ValueError(
            f"gpu-check --collect: {folder / 'results.md'} is damaged (not a gpu-check section from its first "
            "line to its end marker); RESULTS.md and the ledger were not changed."
        )
    return section, incoming


def section_id(section: str) -> str | None:
    match = re.match(re.escape(MARKER).replace(r"\{\}", "(.+?)") + "\n## GPU: ", section)
    return match.group(1) if match else None


def merge_section(text: str, section: str) -> tuple[str, bool]:
    """(`text` with `section` in place of the same run's section, or added at the end; whether it replaced one)."""
    run_id = section_id(section)
    start, end_marker = text.find(MARKER.format(run_id)), END_MARKER.format(run_id)
    if start < 0:
        return text.rstrip("\n") + "\n\n" + section, False
    end = text.find(end_marker, start)
    if end < 0:
        raise ValueError(
            f"RESULTS.md holds the start of run {run_id}'s section but not its end marker: mend it by hand."
        )
    return text[:start] + section.rstrip("\n") + text[end + len(end_marker) :], True


def collect(folder: Path, results_path: Path | None = None) -> int:
    """gpu-check --collect DIR: DIR's section into RESULTS.md (in place of the same run's, else at the end) and
    DIR's ledger merged into the ledger (an item's entry where it was updated later there). Both are read and
    checked before either file changes; collecting the same folder twice changes nothing the second time."""
    root = gpucheck.repository_root()
    section, incoming = read_out_folder(folder)
    ledger = gpuledger.load_ledger(root / LEDGER_PATH)
    results_path = results_path or root / "benchmarks" / "RESULTS.md"
    before = results_path.read_text() if results_path.exists() else "# Measured results\n"
    text, replaced = merge_section(before, section)
    taken = gpuledger.merge_ledgers(ledger, incoming)
    replace_file(results_path, lambda path: path.write_text(text))
    gpuledger.save_ledger(root / LEDGER_PATH, ledger)
    what = "unchanged in" if text == before else "replaced in" if replaced else "added to"
    names = ", ".join(map(gpuledger.item_name, taken)) or "none"
    print(f"section {what} {results_path}; {len(taken)} items of {LEDGER_PATH} updated: {names}")
    return 0


# ---------------------------------------------------------------------------------------------
# tools/gpu_lease.sh prepare


def main(argv: list[str] | None = None) -> int:
    """python -m gpukit.gpulease prepare [--budget SECONDS] [--gpu NAME]: write LEASE_FILE, then print the plan."""
    parser = argparse.ArgumentParser(prog="python -m gpukit.gpulease", description=main.__doc__)
    parser.add_argument("action", choices=["prepare"])
    parser.add_argument("--budget", type=float, default=480.0, help="gpu-check's seconds on the device")
    parser.add_argument("--gpu", default="NVIDIA H200", help="the GPU model the plan is for")
    args = parser.parse_args(argv)
    check_budget(args.budget)
    root = gpucheck.repository_root()
    write_lease_file(root)
    identity, changed = identity_from_lease_file(root), ""
    if identity.changed:
        names = sorted(identity.changed)
        changed = (
            f"; {len(names)} files differ from it ({', '.join(names[:4])}{' …' * (len(names) > 4)}): items that depend"
            " on them will be recorded at commit unknown and stay due (commit them first to avoid it)"
        )
    print(f"{LEASE_FILE}: commit {identity.commit}{changed}")
    return run_budget_check(args.budget, dry_run=True, gpu=args.gpu)


if __name__ == "__main__":
    sys.exit(main())
