"""The GPU ledger (benchmarks/gpu-ledger.json) and the plan of a short lease: `gpu-check --budget SECONDS`.

A lent GPU comes for 15 minutes in all, and `make gpu-check` needs about 28. So every gpu test file, lesson and
benchmark (an *item*, named by its path: "tests/test_memory.py", "notebooks/03_memory_troubleshooting.ipynb",
"benchmarks/fit_overhead.py") has an entry in the ledger: the seconds it takes on a GPU and where that figure
comes from (measured, or an estimate saying how it was derived), the files it depends on, the last run (status,
GPU, torch, commit, time), the last pass and the GPU models it passed on. A lease runs first what is due, in the
order of value. Only one lease is ever certain, and what never ran is where the surprises are:

    0  never run on a GPU
    1  failed on a GPU, and its files changed since  (a fix waiting to be confirmed)
    2  passed on a GPU, and its files changed since
    3  failed on a GPU, its files unchanged since    (expected to fail again)
    4  passed on a GPU, unchanged since, but never on this GPU model

A run recorded at commit "unknown" (its files were not those of a known commit) counts as changed since: it stays
due until a run at a known commit. Tier 4 is the decision for a new GPU model: an item that passed on an H100 and is
unchanged is not re-run ahead of anything else on an H200 (same Hopper chip, same kernels; the bounds the
lessons check are ratios measured on the machine itself), but it is due there once nothing else is, so that
successive leases on a new model cover everything on it too.

Shortest first within a tier (more items per lease), packed into the budget with each item's planned seconds
(its recorded seconds × MARGIN); an item that does not fit is left for the next lease, never started and cut.
Successive leases so cover everything. The planning functions here are pure (the ledger in, a plan out); git is
asked only by `changed_files`. Running a plan is gpukit/gpulease.py's.

An item's files: itself, the gpukit modules it names (`gk.memory.breakdown`, `from gpukit.data import …`; a name
`gpukit/__init__.py` re-exports counts as its module), everything those import inside gpukit, and for a test file
tests/conftest.py and tests/helpers.py.
"""

from __future__ import annotations

import ast
import datetime
import json
import math
import re
import subprocess
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

LEDGER_PATH = "benchmarks/gpu-ledger.json"
MARGIN = 1.25  # planned seconds = recorded seconds × this: an H200 or a busy host runs an item somewhat slower
TIERS = {
    0: "never run on a GPU",
    1: "failed on a GPU; changed since",
    2: "passed on a GPU; changed since",
    3: "failed on a GPU; unchanged since",
    4: "passed on a GPU; unchanged, but never on this GPU model",
}
UNKNOWN = "unknown"  # the commit of a run whose files were no known commit's (a changed working tree, no git)
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


def selected_items(root: Path, only: list[str] | None) -> list[str]:
    """Every item, or those whose names start with one of `only` ("test_memory", "03", "fit_overhead")."""
    items = gpu_items(root)
    if only is None:
        return items
    unmatched = [prefix for prefix in only if not any(item_name(item).startswith(prefix) for item in items)]
    if unmatched:
        raise ValueError(f"gpu-check --only: {', '.join(unmatched)} names no gpu test file, lesson or benchmark.")
    return [item for item in items if any(item_name(item).startswith(prefix) for prefix in only)]


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


STATUSES = ("pass", "fail", "timeout", "skipped", "uncollected", "not run")  # a recorded run's status


def load_ledger(path: Path) -> dict:
    """The ledger at `path` ({"items": {}} where there is none), checked: a ValueError names the file and what is
    wrong with it (not JSON, or an entry without its seconds or with a run that lacks a field)."""
    if not path.exists():
        return {"items": {}}
    try:
        ledger = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is damaged (not JSON: {error}); nothing was changed.") from None
    problem = ledger_problem(ledger)
    if problem:
        raise ValueError(f"{path} is damaged ({problem}); nothing was changed.")
    return ledger


def ledger_problem(ledger) -> str | None:
    """What makes `ledger` no ledger, in a few words; None if it is one."""
    if not isinstance(ledger, dict) or not isinstance(ledger.get("items"), dict):
        return 'no "items" object'
    for item, entry in ledger["items"].items():
        if not isinstance(entry, dict) or not isinstance(entry.get("seconds", 1), (int, float)):
            return f"{item}: not an entry with seconds"
        for key in ("last_run", "last_pass"):
            run = entry.get(key)
            if run is None:
                continue
            if not isinstance(run, dict) or any(not isinstance(run.get(name), str) for name in ("gpu", "date")):
                return f"{item}: its {key} has no gpu or date"
            if run.get("status") not in STATUSES:
                return f"{item}: its {key} has status {run.get('status')!r}"
    return None


def save_ledger(path: Path, ledger: dict) -> None:
    """Write `ledger` to `path` whole or not at all (a temporary file renamed over it): a cut never leaves half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(path.name + ".tmp")
    temporary.write_text(json.dumps(ledger, indent=1, ensure_ascii=False, sort_keys=True) + "\n")
    temporary.replace(path)


GIT_SECONDS = 120  # git diff against an old commit on a busy 2-core machine: seconds, rarely more


def changed_files(root: Path, commit: str) -> set[str] | None:
    """The files that differ between `commit` and the working tree (committed or not); None where this clone
    does not have `commit` (then everything counts as changed). A git that does not answer in GIT_SECONDS is an
    error, not "commit not in this clone": that would silently make every item due."""
    try:
        done = subprocess.run(
            ["git", "diff", "--name-only", commit, "--"],
            cwd=root,
            capture_output=True,
            text=True,
            timeout=GIT_SECONDS,
        )
    except subprocess.TimeoutExpired:
        raise RuntimeError(
            f"gpu-check: `git diff --name-only {commit}` took over {GIT_SECONDS} s in {root}: the plan cannot tell "
            "what changed. Run it again on a quieter machine (or after `git gc`)."
        ) from None
    except OSError:
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


def what_changed(run: dict, deps: list[str], changes: Mapping[str, set[str] | None]) -> str | None:
    """None if none of `deps` changed since `run`'s commit; else, in a few words, what did (or why it cannot tell)."""
    commit = run.get("commit") or UNKNOWN
    if commit == UNKNOWN:
        return "recorded without a commit"
    changed = changes.get(commit)
    if changed is None:
        return "commit not in this clone"
    files = sorted(set(deps) & changed)
    return ", ".join(files[:3]) + (" …" if len(files) > 3 else "") if files else None


def passed_on(entry: dict) -> set[str]:
    """The GPU models the item passed on (an older entry without "passed_on": its last pass's)."""
    models = set(entry.get("passed_on", {}))
    return models | ({entry["last_pass"]["gpu"]} if entry.get("last_pass") else set())


def due(
    entry: dict | None, deps: list[str], changes: Mapping[str, set[str] | None], gpu: str | None = None
) -> tuple[int, str] | None:
    """(tier, reason) if the item is due (see TIERS), None if it passed on a GPU and nothing it depends on changed
    since. `gpu`: the GPU model the plan is for; None ignores the model (tier 4 never)."""
    run = (entry or {}).get("last_run")
    if not run:
        return 0, TIERS[0]
    what = what_changed(run, deps, changes)
    if run["status"] in PASSED:
        if what:
            return 2, f"{TIERS[2]}: {what}"
        if gpu and gpu not in passed_on(entry):
            return 4, f"{TIERS[4]} (passed on {', '.join(sorted(passed_on(entry)))})"
        return None
    if what:
        return 1, f"{TIERS[1]}: {what}"
    return 3, f"{TIERS[3]} ({run['status']} {run.get('date', '')[:10]})"


def planned_seconds(entry: dict | None, default: float) -> tuple[int, str]:
    """(seconds to plan with, where the recorded figure comes from)."""
    if not entry or "seconds" not in entry:
        return math.ceil(default * MARGIN), f"estimate: no figure in the ledger, {default:.0f} s assumed"
    return math.ceil(entry["seconds"] * MARGIN), entry.get("seconds_from", "")


def candidates(
    ledger: dict,
    deps: Mapping[str, list[str]],
    changes: Mapping[str, set[str] | None],
    default_seconds: float = 120,
    gpu: str | None = None,
) -> list[Candidate]:
    """Every due item among `deps`' keys on `gpu` (a model name; None: any), in the order of value: tier, then the
    shortest first."""
    found = []
    for item, item_deps in deps.items():
        entry = ledger["items"].get(item)
        reason = due(entry, item_deps, changes, gpu)
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
    pass and the GPU model it passed on if it passed, and its seconds: measured where it ended by itself, raised
    to at least `seconds` where it was stopped at its own limit (a lower bound)."""
    entry = ledger["items"].setdefault(item, {})
    run = {**machine, "status": status, "seconds": round(seconds, 1), "detail": detail[:300]}
    entry["last_run"], entry["depends_on"], entry["updated"] = run, deps, machine["date"]
    where = f"{machine['gpu']}, {machine['date'][:10]}, commit {machine['commit']}"
    if status == "timeout":
        if seconds > entry.get("seconds", 0):
            entry["seconds"], entry["seconds_from"] = round(seconds), f"lower bound: stopped after it, {where}"
        return
    entry["seconds"], entry["seconds_from"] = round(seconds), f"measured by gpu-check --budget: {status}, {where}"
    if status in PASSED:
        earlier = entry.get("last_pass")  # an older entry's only record of the model it passed on
        known = {earlier["gpu"]: earlier.get("date", "")} if earlier else {}
        entry["passed_on"] = {**known, **entry.get("passed_on", {}), machine["gpu"]: machine["date"]}
        entry["last_pass"] = run


def record_cut(ledger: dict, item: str, seconds: float, why: str, machine: Mapping[str, str]) -> None:
    """Note that `item` was stopped after `seconds` by the lease, not by its own limit (the lease's time ran out, or
    it ran past twice its planned seconds): its last run stays as it was (it is as due as before), and its seconds
    become at least `seconds`, so that the next plan gives it more."""
    entry = ledger["items"].setdefault(item, {})
    if seconds > entry.get("seconds", 0):
        where = f"{machine['gpu']}, {machine['date'][:10]}, commit {machine['commit']}"
        entry["seconds"], entry["seconds_from"] = round(seconds), f"lower bound: {why} after it, {where}"
        entry["updated"] = machine["date"]


def _updated(entry: dict) -> str:
    return entry.get("updated") or (entry.get("last_run") or {}).get("date", "")


def merge_ledgers(local: dict, incoming: dict) -> list[str]:
    """Take from `incoming` (a ledger written on a GPU machine) every item updated there later than in `local`
    (its last run, or a cut's lower bound on its seconds); returns those items. Merging the same ledger again
    takes nothing."""
    taken = []
    for item, entry in incoming["items"].items():
        if _updated(entry) > _updated(local["items"].get(item, {})):
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
    """The plans of `leases` successive leases, each on `machine(lease)` ({"gpu", "torch", "date"}), each assuming
    that what the one before chose passed in its planned seconds, on this working tree (so unchanged since).
    `ledger` is not changed."""
    ledger = json.loads(json.dumps(ledger))  # a copy the simulated passes go into
    changes = {**changes, PLANNED: set()}  # a simulated pass ran this very working tree
    plans = []
    for lease in range(leases):
        plans.append(pack(candidates(ledger, deps, changes, gpu=machine(lease)["gpu"]), budget))
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


def format_plans(plans: list[Plan], gpu: str, budget: float | None = None) -> str:
    """Each lease's items with planned seconds and why each is due; then what no lease of this budget fits.
    `budget`: the whole check's seconds, where the items get less (the check's own start, pre-flight, writing)."""
    budget = plans[0].budget if budget is None else budget
    own = f" ({budget - plans[0].budget:.0f} s of it the check's own)" if budget > plans[0].budget else ""
    lines = [
        f"gpu-check --budget {budget:.0f}{own}: {len(plans)} lease(s) on {gpu}, planned from {LEDGER_PATH}",
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
