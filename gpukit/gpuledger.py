"""The GPU ledger (benchmarks/gpu-ledger.json) and the plan of a short lease: `gpu-check --budget SECONDS`.

A lent GPU comes for 15 minutes in all, and `make gpu-check` needs about 28. So every gpu test file, lesson and
benchmark (an *item*, named by its path: "tests/test_memory.py", "notebooks/03_memory_troubleshooting.ipynb",
"benchmarks/fit_overhead.py") has an entry in the ledger: the seconds it takes on a GPU and where that figure
comes from (measured, or an estimate saying how it was derived), the files it depends on, the last run (status,
GPU, torch, commit, time) and the last pass. A lease runs first what is due, in the order of value:

    0  failed on a GPU, and its files changed since  (a fix waiting to be confirmed)
    1  never run on a GPU
    2  passed on a GPU, and its files changed since
    3  failed on a GPU, its files unchanged since    (expected to fail again: last)

shortest first within a tier (more items per lease), packed into the budget with each item's planned seconds
(its recorded seconds × MARGIN); an item that does not fit is left for the next lease, never started and cut.
Successive leases so cover everything. The planning functions here are pure (the ledger in, a plan out); git is
asked only by `changed_files`.

An item's files: itself, the gpukit modules it names (`gk.memory.breakdown`, `from gpukit.data import …`; a name
`gpukit/__init__.py` re-exports counts as its module), everything those import inside gpukit, and for a test file
tests/conftest.py and tests/helpers.py.
"""

from __future__ import annotations

import ast
import datetime
import functools
import json
import math
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from . import gpucheck
from .runfile import git_commit

LEDGER_PATH = "benchmarks/gpu-ledger.json"
MARGIN = 1.25  # planned seconds = recorded seconds × this: an H200 or a busy host runs an item somewhat slower
TIERS = {
    0: "failed on a GPU; changed since",
    1: "never run on a GPU",
    2: "passed on a GPU; changed since",
    3: "failed on a GPU; unchanged since",
}
PASSED = ("pass", "skipped")  # "skipped": a benchmark that needs two GPUs said so on one, which is its right answer
GPU_MARK = re.compile(r"^\s*(?:@pytest\.mark\.gpu\b|\w+\s*=\s*pytest\.mark\.gpu\b)", re.MULTILINE)
NAMED_MODULE = re.compile(r"\b(?:gk|gpukit)\.([a-z_0-9]+)(?:\.([A-Za-z_0-9]+))?")
TEST_HELPERS = ("tests/conftest.py", "tests/helpers.py")
PLANNED = "(planned)"  # the commit of a pass plan_leases assumes: this working tree


# ---------------------------------------------------------------------------------------------
# Items and the files they depend on


def gpu_items(root: Path) -> list[str]:
    """Every item, as a path from the checkout's root: test files with a gpu test, lessons, benchmarks."""
    tests = [p for p in sorted((root / "tests").glob("test_*.py")) if GPU_MARK.search(p.read_text())]
    lessons = sorted((root / "notebooks").glob("[0-9][0-9]*_*.ipynb"))
    benchmarks = sorted((root / "benchmarks").glob("*.py"))
    return [path.relative_to(root).as_posix() for path in [*tests, *lessons, *benchmarks]]


def item_kind(item: str) -> str:
    return {"tests": "tests", "notebooks": "lesson", "benchmarks": "benchmark"}[item.split("/")[0]]


def item_name(item: str) -> str:
    """ "test_memory", "03_memory_troubleshooting", "fit_overhead": what --only and the summary call it."""
    return Path(item).stem


def python_source(path: Path) -> str:
    """A .py file's text, or a notebook's code cells joined."""
    if path.suffix != ".ipynb":
        return path.read_text()
    cells = json.loads(path.read_text())["cells"]
    return "\n".join("".join(cell["source"]) for cell in cells if cell["cell_type"] == "code")


def _module_file(root: Path, dotted: str) -> str | None:
    parts = dotted.split(".")
    for candidate in (Path(*parts).with_suffix(".py"), Path(*parts, "__init__.py")):
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def _imported(tree: ast.AST, package: str) -> set[tuple[str, str | None]]:
    """(module, name) for each gpukit name `tree` imports: ("gpukit.memory", "breakdown") for `from gpukit.memory
    import breakdown`, ("gpukit.memory", None) for `import gpukit.memory`; relative imports resolved against
    `package` (the importing module's package)."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {(alias.name, None) for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(filter(None, [*anchor, base]))
            names |= {(base, alias.name) for alias in node.names}
    return {(module, name) for module, name in names if module == "gpukit" or module.startswith("gpukit.")}


def _defining_module(root: Path, module: str, name: str | None, depth: int = 0) -> str:
    """The module that defines `module.name`: a submodule of that name, else the module its package's __init__
    takes the name from (`gpukit.memory` + `breakdown` → `gpukit.memory.parts`), else `module` itself."""
    if name is None or depth > 4:
        return module
    if _module_file(root, f"{module}.{name}"):
        return f"{module}.{name}"
    init = root / Path(*module.split("."), "__init__.py")
    if not init.is_file():
        return module
    for source, imported in _imported(ast.parse(init.read_text()), module):
        if imported == name and source != module:
            return _defining_module(root, source, name, depth + 1)
    defines = re.compile(rf"^(?:class |def ){re.escape(name)}\b|^{re.escape(name)}\s*[:=]", re.MULTILINE)
    for path in sorted(init.parent.glob("*.py")):  # a name the package loads lazily (its __getattr__)
        if path.name != "__init__.py" and defines.search(path.read_text()):
            return f"{module}.{path.stem}"
    return module


def reexports(root: Path) -> dict[str, str]:
    """{name: module} for what gpukit/__init__.py takes from its modules ("fit": "gpukit.train")."""
    tree = ast.parse((root / "gpukit" / "__init__.py").read_text())
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
            found |= {alias.asname or alias.name: f"gpukit.{node.module}" for alias in node.names}
    return found


def _files_of(root: Path, imports: Iterable[tuple[str, str | None]]) -> set[str]:
    """The files that define what `imports` names; a package imported whole is its __init__.py."""
    modules = {_defining_module(root, module, name) for module, name in imports}
    files = {_module_file(root, module) for module in modules if module != "gpukit"}
    return {file for file in files if file}


def dependencies(root: Path, item: str) -> list[str]:
    """The files `item` depends on (see the module's docstring), sorted."""
    source = python_source(root / item)
    try:
        named = _imported(ast.parse(source), "")
    except SyntaxError:  # a notebook cell with a magic: the names below still count
        named = set()
    exported = reexports(root)
    for first, second in NAMED_MODULE.findall(source):
        if _module_file(root, f"gpukit.{first}"):  # gk.memory.breakdown
            named.add((f"gpukit.{first}", second or None))
        elif first in exported:  # gk.fit
            named.add((exported[first], first))
    found, todo = {item}, _files_of(root, named)
    while todo:  # what those files import inside gpukit, and so on
        file = todo.pop()
        found.add(file)
        package = file.removesuffix(".py").replace("/", ".").removesuffix(".__init__")
        package = package if file.endswith("__init__.py") else package.rpartition(".")[0]
        todo |= _files_of(root, _imported(ast.parse((root / file).read_text()), package)) - found
    if item_kind(item) == "tests":
        found |= {helper for helper in TEST_HELPERS if (root / helper).is_file()}
    return sorted(found)


# ---------------------------------------------------------------------------------------------
# The ledger's file, and git


def load_ledger(path: Path) -> dict:
    return json.loads(path.read_text()) if path.exists() else {"items": {}}


def save_ledger(path: Path, ledger: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(ledger, indent=1, ensure_ascii=False, sort_keys=True) + "\n")


def changed_files(root: Path, commit: str) -> set[str] | None:
    """The files that differ between `commit` and the working tree (committed or not); None where this clone
    does not have `commit` (then everything counts as changed)."""
    try:
        done = subprocess.run(
            ["git", "diff", "--name-only", commit, "--"], cwd=root, capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return set(done.stdout.split()) if done.returncode == 0 else None


def changes_by_commit(root: Path, ledger: dict, head: str | None) -> dict[str, set[str] | None]:
    """changed_files for every commit the ledger names, and for `head` (this checkout's commit)."""
    commits = {run["commit"] for entry in ledger["items"].values() for run in _runs(entry) if run.get("commit")}
    return {commit: changed_files(root, commit) for commit in sorted(commits | ({head} if head else set()))}


def _runs(entry: dict) -> list[dict]:
    return [run for run in (entry.get("last_run"), entry.get("last_pass")) if run]


# ---------------------------------------------------------------------------------------------
# Planning (pure)


@dataclass
class Candidate:
    item: str
    tier: int
    reason: str
    seconds: int  # planned: recorded × MARGIN, rounded up
    source: str  # where the recorded seconds come from


@dataclass
class Plan:
    budget: float
    chosen: list[Candidate] = field(default_factory=list)
    later: list[Candidate] = field(default_factory=list)  # due, but did not fit in what was left
    too_long: list[Candidate] = field(default_factory=list)  # longer than the whole budget: never fits

    @property
    def seconds(self) -> int:
        return sum(candidate.seconds for candidate in self.chosen)


def _changed(run: dict, deps: list[str], changes: Mapping[str, set[str] | None]) -> list[str] | None:
    """The files among `deps` changed since `run`'s commit ([] none); None if that commit is unknown here."""
    changed = changes.get(run.get("commit") or "")
    return None if changed is None else sorted(set(deps) & changed)


def due(entry: dict | None, deps: list[str], changes: Mapping[str, set[str] | None]) -> tuple[int, str] | None:
    """(tier, reason) if the item is due, None if it passed on a GPU and nothing it depends on changed since."""
    run = (entry or {}).get("last_run")
    if not run:
        return 1, TIERS[1]
    changed = _changed(run, deps, changes)
    what = (
        "commit not in this clone" if changed is None else ", ".join(changed[:3]) + (" …" if len(changed) > 3 else "")
    )
    if run["status"] in PASSED:
        return (2, f"{TIERS[2]}: {what}") if changed is None or changed else None
    if changed is None or changed:
        return 0, f"{TIERS[0]}: {what}"
    return 3, f"{TIERS[3]} ({run['status']} {run.get('date', '')[:10]})"


def planned_seconds(entry: dict | None, default: float) -> tuple[int, str]:
    """(seconds to plan with, where the recorded figure comes from)."""
    if not entry or "seconds" not in entry:
        return math.ceil(default * MARGIN), f"estimate: no figure in the ledger, {default:.0f} s assumed"
    return math.ceil(entry["seconds"] * MARGIN), entry.get("seconds_from", "")


def candidates(
    ledger: dict, deps: Mapping[str, list[str]], changes: Mapping[str, set[str] | None], default_seconds: float = 120
) -> list[Candidate]:
    """Every due item among `deps`' keys, in the order of value: tier, then the shortest first."""
    found = []
    for item, item_deps in deps.items():
        entry = ledger["items"].get(item)
        reason = due(entry, item_deps, changes)
        if reason:
            found.append(Candidate(item, *reason, *planned_seconds(entry, default_seconds)))
    return sorted(found, key=lambda candidate: (candidate.tier, candidate.seconds, candidate.item))


def pack(ordered: list[Candidate], budget: float) -> Plan:
    """Take `ordered` candidates in turn while they fit in what is left of `budget`; skip one that does not
    (a shorter one after it may fit). An item longer than the whole budget goes to too_long."""
    plan, left = Plan(budget), budget
    for candidate in ordered:
        if candidate.seconds > budget:
            plan.too_long.append(candidate)
        elif candidate.seconds <= left:
            plan.chosen.append(candidate)
            left -= candidate.seconds
        else:
            plan.later.append(candidate)
    return plan


# ---------------------------------------------------------------------------------------------
# Recording what ran (pure), and merging a ledger that came back from a GPU machine


def record(
    ledger: dict, item: str, status: str, seconds: float, detail: str, machine: Mapping[str, str], deps: list[str]
) -> None:
    """Note in `ledger` that `item` ran on `machine` ({"gpu", "torch", "commit", "date"}): its last run, its last
    pass if it passed, and its seconds: measured where it ended by itself, raised to at least `seconds` where it
    was stopped (a lower bound), kept where it never started."""
    entry = ledger["items"].setdefault(item, {})
    run = {**machine, "status": status, "seconds": round(seconds, 1), "detail": detail[:300]}
    entry["last_run"], entry["depends_on"] = run, deps
    where = f"{machine['gpu']}, {machine['date'][:10]}, commit {machine['commit']}"
    if status == "timeout":
        if seconds > entry.get("seconds", 0):
            entry["seconds"], entry["seconds_from"] = round(seconds), f"lower bound: stopped after it, {where}"
        return
    entry["seconds"], entry["seconds_from"] = round(seconds), f"measured by gpu-check --budget: {status}, {where}"
    if status in PASSED:
        entry["last_pass"] = run


def merge_ledgers(local: dict, incoming: dict) -> list[str]:
    """Take from `incoming` (a ledger written on a GPU machine) every item whose last run is newer than
    `local`'s; returns those items."""
    taken = []
    for item, entry in incoming["items"].items():
        ours = local["items"].get(item, {})
        theirs_at, ours_at = (entry.get("last_run") or {}).get("date", ""), (ours.get("last_run") or {}).get("date", "")
        if theirs_at > ours_at:
            local["items"][item] = entry
            taken.append(item)
    return taken


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


# ---------------------------------------------------------------------------------------------
# Several leases ahead, and the plan as text


def plan_leases(
    ledger: dict,
    deps: Mapping[str, list[str]],
    changes: Mapping[str, set[str] | None],
    budget: float,
    leases: int,
    machine: Callable[[int], dict],
) -> list[Plan]:
    """The plans of `leases` successive leases, each assuming that what the one before chose passed in its
    planned seconds on `machine(lease)`, on this working tree (so unchanged since). `ledger` is not changed."""
    ledger = json.loads(json.dumps(ledger))  # a copy the simulated passes go into
    changes = {**changes, PLANNED: set()}  # a simulated pass ran this very working tree
    plans = []
    for lease in range(leases):
        plans.append(pack(candidates(ledger, deps, changes), budget))
        for candidate in plans[-1].chosen:
            entry = ledger["items"].setdefault(candidate.item, {})
            seconds, source = entry.get("seconds"), entry.get("seconds_from")
            record(ledger, candidate.item, "pass", 0, "", {**machine(lease), "commit": PLANNED}, deps[candidate.item])
            if seconds is not None:  # a plan, not a measurement: the recorded figure stays
                entry["seconds"], entry["seconds_from"] = seconds, source
    return plans


def _plan_row(candidate: Candidate) -> str:
    return (
        f"  {item_kind(candidate.item):<9} {item_name(candidate.item):<36} {candidate.seconds:>4} s  {candidate.reason}"
    )


def format_plans(plans: list[Plan], gpu: str) -> str:
    """Each lease's items with planned seconds and why each is due; then what no lease of this budget fits."""
    lines = [
        f"gpu-check --budget {plans[0].budget:.0f}: {len(plans)} lease(s) on {gpu}, planned from {LEDGER_PATH}",
        f"(planned seconds: the ledger's × {MARGIN}; each item's source is in the ledger's seconds_from)",
    ]
    for number, plan in enumerate(plans, 1):
        lines.append(f"lease {number}: {len(plan.chosen)} item(s), {plan.seconds} s of {plan.budget:.0f}")
        lines += [_plan_row(candidate) for candidate in plan.chosen] or ["  nothing is due"]
        if plan.later:
            lines.append(f"  left for a later lease: {', '.join(item_name(c.item) for c in plan.later)}")
    for candidate in plans[-1].too_long:
        lines.append(
            f"longer than the budget ({candidate.seconds} s planned): {candidate.item}; "
            f"run it alone with --budget {candidate.seconds} --only {item_name(candidate.item)}"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# gpu-check --budget: plan, run, record


ITEM_LIMITS = {
    "tests": gpucheck.TESTS_SECONDS,
    "lesson": gpucheck.LESSON_SECONDS,
    "benchmark": gpucheck.BENCHMARK_SECONDS,
}
OUT_FILES = ("summary.txt", "results.md", "gpu-ledger.json", "logs.tar.gz")  # what --out DIR receives


def run_item(root: Path, logs: Path, item: str, limit: float) -> gpucheck.StepResult:
    kind = item_kind(item)
    if kind == "tests":
        return gpucheck.run_tests(root, logs, limit, files=[item])
    if kind == "lesson":
        return gpucheck.run_lesson(root, logs, root / item, limit)
    return gpucheck.run_benchmark(root, logs, root / item, limit)


def run_plan(root: Path, logs: Path, plan: Plan, ledger: dict, deps: Mapping, machine: dict, report=print) -> list:
    """Run `plan.chosen` in order within `plan.budget` seconds, recording each in `ledger`. An item is started
    only if its planned seconds fit in what is left (an earlier one may have run over its plan); each runs under
    the smaller of what is left and its kind's own limit."""
    deadline, results, lessons_problem = time.monotonic() + plan.budget, [], None
    if any(item_kind(c.item) == "lesson" for c in plan.chosen):
        lessons_problem = gpucheck.lessons_cannot_run(root, logs)
        results += [lessons_problem] if lessons_problem else []
    for candidate in plan.chosen:
        kind, name, left = item_kind(candidate.item), item_name(candidate.item), deadline - time.monotonic()
        if candidate.seconds > left or (kind == "lesson" and lessons_problem):
            why = "nbval does not import" if kind == "lesson" and lessons_problem else f"{left:.0f} s were left"
            results.append(gpucheck.StepResult(kind, name, "not started", 0.0, f"{candidate.seconds} s planned, {why}"))
        else:
            results.append(run_item(root, logs, candidate.item, min(left, ITEM_LIMITS[kind])))
            result = results[-1]
            record(
                ledger,
                candidate.item,
                result.status,
                result.seconds,
                result.detail,
                {**machine, "date": now()},
                deps[candidate.item],
            )
        report(gpucheck.summary_row(results[-1]))
    return results


def selected_items(root: Path, only: list[str] | None) -> list[str]:
    """Every item, or those whose names start with one of `only` ("test_memory", "03", "fit_overhead")."""
    items = gpu_items(root)
    if only is None:
        return items
    unmatched = [prefix for prefix in only if not any(item_name(item).startswith(prefix) for item in items)]
    if unmatched:
        raise ValueError(f"gpu-check --only: {', '.join(unmatched)} names no gpu test file, lesson or benchmark.")
    return [item for item in items if any(item_name(item).startswith(prefix) for prefix in only)]


def write_outputs(out: Path, logs: Path, section: str, summary: str, ledger: dict) -> None:
    """OUT_FILES into `out`: what comes back from a lent machine (at most 8 files, 16 MiB each)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.md").write_text(section)
    (out / "summary.txt").write_text(summary + "\n")
    save_ledger(out / "gpu-ledger.json", ledger)
    with tarfile.open(out / "logs.tar.gz", "w:gz") as archive:
        archive.add(logs, arcname=logs.name)


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
    """gpu-check --budget: plan from the ledger and run the plan (or, `dry_run`, print `leases` plans for `gpu`,
    running nothing, GPU or not); record each item in the ledger; the section, summary, ledger and logs go to
    `out` if given, else the section to `results_path` (default benchmarks/RESULTS.md) and the ledger in place."""
    if budget <= 0 or leases < 1:
        raise ValueError(f"gpu-check --budget must be > 0 seconds and --leases >= 1 (got {budget}, {leases}).")
    root = gpucheck.repository_root()
    ledger, items = load_ledger(root / LEDGER_PATH), selected_items(root, only)
    deps, head = {item: dependencies(root, item) for item in items}, git_commit(root) or "unknown"
    changes = changes_by_commit(root, ledger, head)
    if dry_run:
        machine = {"gpu": gpu, "torch": "planned", "date": now()}
        print(format_plans(plan_leases(ledger, deps, changes, budget, leases, lambda _: machine), gpu))
        return 0
    message = gpucheck.no_gpu_message()
    if message:
        print(message, file=sys.stderr)
        return gpucheck.EXIT_NO_GPU
    machine = gpucheck.describe_machine(root)
    plan = pack(candidates(ledger, deps, changes), budget)
    print(format_plans([plan], machine.gpu), flush=True)
    logs = log_dir or root / "runs" / "gpu-check" / datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    identity = {"gpu": machine.gpu, "torch": machine.torch, "commit": head[:12]}
    results = run_plan(root, logs, plan, ledger, deps, identity, functools.partial(print, flush=True))
    seconds = time.monotonic() - started
    section = gpucheck.results_section(machine, results, seconds, f"gpu-check --budget {budget:.0f}")
    save_ledger(root / LEDGER_PATH, ledger)
    if out:
        text = gpucheck.summary(machine, results, seconds, None, logs)
        write_outputs(out, logs, section, text, ledger)
    else:
        text = gpucheck.summary(machine, results, seconds, results_path or root / "benchmarks" / "RESULTS.md", logs)
        gpucheck.append_section(results_path or root / "benchmarks" / "RESULTS.md", section)
    print("\n" + text)
    return gpucheck.exit_code(results)


def collect(folder: Path, results_path: Path | None = None) -> int:
    """gpu-check --collect DIR: DIR/results.md appended to benchmarks/RESULTS.md and DIR/gpu-ledger.json merged
    into the ledger (an item's entry taken where its last run there is newer), running nothing."""
    root = gpucheck.repository_root()
    missing = [name for name in ("results.md", "gpu-ledger.json") if not (folder / name).is_file()]
    if missing:
        raise FileNotFoundError(
            f"gpu-check --collect: {folder} has no {', '.join(missing)}; give the folder "
            "`gpu-check --budget … --out DIR` wrote (tools/gpu_lease.sh: $OUT)."
        )
    results_path = results_path or root / "benchmarks" / "RESULTS.md"
    gpucheck.append_section(results_path, (folder / "results.md").read_text())
    ledger = load_ledger(root / LEDGER_PATH)
    taken = merge_ledgers(ledger, load_ledger(folder / "gpu-ledger.json"))
    save_ledger(root / LEDGER_PATH, ledger)
    print(
        f"section added to {results_path}; {len(taken)} items of {LEDGER_PATH} updated: {', '.join(map(item_name, taken))}"
    )
    return 0
