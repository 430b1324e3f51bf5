"""The GPU ledger and the plan of a short lease (gpukit/gpuledger.py): pure functions on made-up ledgers, git on a
repository made here, and `gpu-check --budget` with its items replaced by made-up results (no GPU needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gpukit import cli, gpucheck, gpulease, gpuledger

REPO_ROOT = Path(__file__).resolve().parents[1]
H100 = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0+cu130", "date": "2026-11-24T10:00:00"}


def run(status: str, commit: str = "old", seconds: float = 10) -> dict:
    return {**H100, "commit": commit, "status": status, "seconds": seconds, "detail": ""}


def entry(status: str | None, seconds: float, commit: str = "old") -> dict:
    made = {"seconds": seconds, "seconds_from": "made up"}
    if status:
        made["last_run"] = run(status, commit, seconds)
    if status == "pass":
        made["last_pass"] = made["last_run"]
    return made


def test_what_is_due_and_its_tier():
    changes = {"old": {"gpukit/memory/plan.py"}}
    assert gpuledger.due(None, ["a.py"], changes) == (0, "never run on a GPU")
    assert gpuledger.due(entry("pass", 5), ["a.py"], changes) is None  # passed, nothing of it changed
    assert gpuledger.due(entry("skipped", 5), ["a.py"], changes) is None  # a two-GPU benchmark on one GPU
    tier, reason = gpuledger.due(entry("pass", 5), ["a.py", "gpukit/memory/plan.py"], changes)
    assert tier == 2 and reason.endswith("gpukit/memory/plan.py")
    assert gpuledger.due(entry("fail", 5), ["gpukit/memory/plan.py"], changes)[0] == 1  # a fix to confirm
    assert gpuledger.due(entry("timeout", 5), ["a.py"], changes)[0] == 3  # unchanged: expected to fail again
    assert gpuledger.due(entry("pass", 5, commit="gone"), ["a.py"], {"gone": None}) == (
        2,
        "passed on a GPU; changed since: commit not in this clone",
    )


def test_a_run_recorded_without_a_commit_stays_due():
    """A run whose files were no known commit's (a changed working tree, a copy without .git) proves nothing
    about any commit: every later plan counts it as changed, whatever git says of the commit "unknown"."""
    for status, tier in (("pass", 2), ("fail", 1)):
        found = gpuledger.due(entry(status, 5, commit=gpuledger.UNKNOWN), ["a.py"], {gpuledger.UNKNOWN: set()})
        assert found == (tier, f"{gpuledger.TIERS[tier]}: recorded without a commit")
    assert gpuledger.due(entry("pass", 5, commit=""), ["a.py"], {"": set()})[0] == 2  # no commit at all: the same


def test_a_new_gpu_model_makes_unchanged_passes_due_last():
    """The decision: a pass on an H100 is not re-run ahead of anything else on an H200, but is due there once
    nothing else is (tier 4), until it has passed on the H200 too."""
    passed = entry("pass", 5)
    assert gpuledger.due(passed, ["a.py"], {"old": set()}, gpu=H100["gpu"]) is None
    tier, reason = gpuledger.due(passed, ["a.py"], {"old": set()}, gpu="NVIDIA H200")
    assert (tier, reason) == (4, f"{gpuledger.TIERS[4]} (passed on {H100['gpu']})")
    ledger = {"items": {"tests/test_c.py": passed, "tests/test_new.py": {"seconds": 400}}}
    deps = {item: [item] for item in ledger["items"]}
    found = gpuledger.candidates(ledger, deps, {"old": set()}, gpu="NVIDIA H200")
    assert [(c.item, c.tier) for c in found] == [("tests/test_new.py", 0), ("tests/test_c.py", 4)]  # longer, first
    machine = {"gpu": "NVIDIA H200", "torch": "2.11", "commit": "new", "date": "2026-12-01T10:00:00"}
    gpuledger.record(ledger, "tests/test_c.py", "pass", 6, "ok", machine, ["tests/test_c.py"])
    assert gpuledger.passed_on(ledger["items"]["tests/test_c.py"]) == {H100["gpu"], "NVIDIA H200"}
    assert gpuledger.due(ledger["items"]["tests/test_c.py"], ["tests/test_c.py"], {"new": set()}, "NVIDIA H200") is None


def test_candidates_come_in_the_order_of_value_and_pack_never_starts_what_cannot_finish():
    ledger = {
        "items": {
            "notebooks/01_a.ipynb": entry("fail", 200),  # tier 1, 250 s planned
            "benchmarks/b.py": entry("fail", 40),  # tier 1, 50 s
            "tests/test_c.py": entry("pass", 8),  # tier 2, 10 s
            "notebooks/04_d.ipynb": entry("pass", 1000),  # tier 2, longer than any lease of 480 s
            "notebooks/05_e.ipynb": entry("pass", 100),  # not due
        }
    }
    deps = {item: [item] for item in [*ledger["items"], "benchmarks/new.py"]}
    changes = {"old": set(deps) - {"notebooks/05_e.ipynb"}}
    found = gpuledger.candidates(ledger, deps, changes, default_seconds=160)
    assert [(c.item, c.tier, c.seconds) for c in found] == [
        ("benchmarks/new.py", 0, 200),  # never run: first; no figure: the default, × MARGIN, said to be an estimate
        ("benchmarks/b.py", 1, 50),
        ("notebooks/01_a.ipynb", 1, 250),
        ("tests/test_c.py", 2, 10),
        ("notebooks/04_d.ipynb", 2, 1250),
    ]
    assert found[0].source.startswith("estimate:")
    plan = gpuledger.pack(found, 480)
    assert [c.item for c in plan.chosen] == ["benchmarks/new.py", "benchmarks/b.py", "tests/test_c.py"]
    assert plan.seconds == 260 <= plan.budget  # lesson 01 (250 s) did not fit in the 230 s left; test_c (10 s) did
    assert [c.item for c in plan.later] == ["notebooks/01_a.ipynb"]
    assert [c.item for c in plan.too_long] == ["notebooks/04_d.ipynb"]


def test_four_leases_cover_everything_due_and_leave_the_ledger_as_it_was():
    items = [f"notebooks/{n:02d}_x.ipynb" for n in range(8)]
    ledger = {"items": {item: entry("fail", 60 + 20 * n) for n, item in enumerate(items)}}
    before = json.dumps(ledger, sort_keys=True)
    deps = {item: [item] for item in items}
    # planned 75, 100, …, 250 s (× MARGIN): 1,300 s in all, more than two leases of 500 s can hold
    plans = gpuledger.plan_leases(ledger, deps, {"old": set(items)}, 500, 4, lambda lease: dict(H100))
    assert json.dumps(ledger, sort_keys=True) == before
    chosen = [[c.item for c in plan.chosen] for plan in plans]
    assert chosen == [items[:4], items[4:6], items[6:], []]  # shortest first; each once; then nothing is due
    assert [plan.seconds for plan in plans] == [450, 375, 475, 0]
    text = gpuledger.format_plans(plans, "NVIDIA H100 80GB HBM3")
    assert [line.split(":")[0] for line in text.splitlines() if line.startswith("lease ")] == [
        f"lease {n}" for n in range(1, 5)
    ]


def test_recording_a_run_and_merging_a_ledger_from_a_gpu_machine():
    ledger = {"items": {"benchmarks/b.py": entry("fail", 40)}}
    machine = {**H100, "commit": "new", "date": "2026-11-28T10:00:00"}
    gpuledger.record(ledger, "benchmarks/b.py", "timeout", 55, "stopped", machine, ["benchmarks/b.py"])
    record = ledger["items"]["benchmarks/b.py"]
    assert record["seconds"] == 55 and record["seconds_from"].startswith("lower bound")  # stopped: at least 55 s
    assert "last_pass" not in record and record["last_run"]["status"] == "timeout"
    gpuledger.record(ledger, "benchmarks/b.py", "pass", 31.3, "1 table", machine, ["benchmarks/b.py"])
    assert record["seconds"] == 31 and record["last_pass"]["commit"] == "new"
    local = {"items": {"benchmarks/b.py": entry("fail", 40), "tests/test_c.py": entry("pass", 9)}}
    assert gpuledger.merge_ledgers(local, ledger) == ["benchmarks/b.py"]
    assert local["items"]["benchmarks/b.py"] == record and local["items"]["tests/test_c.py"]["seconds"] == 9
    assert gpuledger.merge_ledgers(local, ledger) == []  # the same ledger again: nothing newer
    assert gpuledger.merge_ledgers(local, {"items": {"tests/test_c.py": entry("fail", 1)}}) == []  # older: kept


def test_a_cut_raises_the_seconds_and_leaves_the_item_as_due_as_before():
    """An item the lease stopped (its time ran out, or 2x its plan) did not fail: it keeps its last run (here none:
    still never run, first in the next plan) and gets at least the seconds it had, which merge carries back."""
    ledger = {"items": {"notebooks/10_x.ipynb": {"seconds": 89, "seconds_from": "estimate"}}}
    machine = {**H100, "commit": "new", "date": "2026-11-28T10:00:00"}
    gpuledger.record_cut(ledger, "notebooks/10_x.ipynb", 223.4, "stopped at 2x its planned seconds", machine)
    cut = ledger["items"]["notebooks/10_x.ipynb"]
    assert cut["seconds"] == 223 and cut["seconds_from"].startswith("lower bound: stopped at 2x")
    assert gpuledger.due(cut, ["notebooks/10_x.ipynb"], {})[0] == 0
    local = {"items": {"notebooks/10_x.ipynb": {"seconds": 89, "seconds_from": "estimate"}}}
    assert gpuledger.merge_ledgers(local, ledger) == ["notebooks/10_x.ipynb"] and local == ledger
    gpuledger.record_cut(ledger, "notebooks/10_x.ipynb", 100, "again", machine)
    assert ledger["items"]["notebooks/10_x.ipynb"]["seconds"] == 223  # a shorter cut says nothing new


def test_changed_files_come_from_git_including_uncommitted_changes(tmp_path):
    def git(*args):
        return subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tmp_path / "a.py").write_text("one\n")
    (tmp_path / "b.py").write_text("one\n")
    git("add", ".")
    git("-c", "user.email=t@t", "-c", "user.name=t", "commit", "-qm", "first")
    first = git("rev-parse", "HEAD").strip()
    assert gpuledger.changed_files(tmp_path, first) == set()
    (tmp_path / "b.py").write_text("two\n")  # not committed
    assert gpuledger.changed_files(tmp_path, first) == {"b.py"}
    assert gpuledger.changed_files(tmp_path, "0" * 40) is None


def test_dependencies_follow_names_to_the_modules_that_define_them():
    deps = gpuledger.dependencies(REPO_ROOT, "benchmarks/monitor_overhead.py")
    assert "benchmarks/monitor_overhead.py" in deps and "gpukit/hardware/monitor.py" in deps
    assert "gpukit/distributed/launcher.py" not in deps  # not reached from what it imports
    assert {"tests/conftest.py", "tests/helpers.py"} <= set(gpuledger.dependencies(REPO_ROOT, "tests/test_bench.py"))


def test_the_committed_ledger_has_every_item_with_a_labelled_figure():
    ledger = gpuledger.load_ledger(REPO_ROOT / gpuledger.LEDGER_PATH)
    assert set(gpuledger.gpu_items(REPO_ROOT)) <= set(ledger["items"])
    for item, record in ledger["items"].items():
        assert record["seconds"] > 0, item
        assert record["seconds_from"].startswith(("measured", "estimate", "lower bound")), item


def fake_checkout(tmp_path: Path) -> Path:
    """A checkout with one gpu test file, two lessons and a benchmark, and a ledger for them."""
    for folder, name, text in [
        ("tests", "test_g.py", "import pytest\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n"),
        ("tests", "test_cpu.py", "def test_y():\n    pass\n"),
        ("notebooks", "01_a.ipynb", json.dumps({"cells": []})),
        ("notebooks", "02_b.ipynb", json.dumps({"cells": []})),
        ("benchmarks", "b.py", "print(1)\n"),
        ("gpukit", "__init__.py", ""),
    ]:
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / name).write_text(text)
    ledger = {"items": {"notebooks/01_a.ipynb": entry("fail", 200), "notebooks/02_b.ipynb": entry("fail", 300)}}
    gpuledger.save_ledger(tmp_path / gpuledger.LEDGER_PATH, ledger)
    return tmp_path


def test_the_dry_run_prints_four_leases_without_a_gpu(monkeypatch, tmp_path, capsys):
    root = fake_checkout(tmp_path)
    monkeypatch.setattr(gpucheck, "repository_root", lambda: root)
    monkeypatch.setattr(gpucheck, "no_gpu_message", lambda: "no GPU here")
    arguments = ["gpu-check", "--budget", "480", "--dry-run", "--leases", "4"]
    assert cli.main(arguments) == 0
    lines = capsys.readouterr().out.splitlines()
    own = gpulease.own_seconds()
    assert lines[0] == (
        f"gpu-check --budget 480 ({own} s of it the check's own): 4 lease(s) on NVIDIA H200, "
        f"planned from {gpuledger.LEDGER_PATH}"
    )
    leases = [line for line in lines if line.startswith("lease ")]
    assert leases == [
        f"lease 1: 2 item(s), 300 s of {480 - own}",  # never run: the benchmark and the gpu test file, 150 s each
        f"lease 2: 1 item(s), 250 s of {480 - own}",  # lesson 01 (failed: 250 s); lesson 02 (375 s) no longer fits
        f"lease 3: 1 item(s), 375 s of {480 - own}",
        f"lease 4: 0 item(s), 0 s of {480 - own}",
    ]
    assert "test_g" in "\n".join(lines) and "test_cpu" not in "\n".join(lines)  # only files with a gpu test
    assert lines[-1].startswith("note: no commit to record") and "counts as changed" in lines[-1]  # no git here
    assert cli.main(["gpu-check", "--budget", "480", "--dry-run", "--only", "zz"]) == cli.EXIT_BAD_INPUT


def _module_names_imported() -> set[str]:
    """Top-level modules the tests, lessons, benchmarks and gpukit import (not the standard library's)."""
    import ast

    names = set()
    sources = [*REPO_ROOT.glob("gpukit/**/*.py"), *REPO_ROOT.glob("tests/*.py"), *REPO_ROOT.glob("benchmarks/*.py")]
    sources += list(REPO_ROOT.glob("notebooks/*.ipynb"))
    for path in sources:
        for node in ast.walk(ast.parse(gpuledger.python_source(path))):
            if isinstance(node, ast.Import):
                names |= {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names - set(sys.stdlib_module_names)


# Modules the lent GPU image has (tools/gpu-wheels.txt's header), as imported; and this checkout's own.
IN_THE_IMAGE = {
    "torch",
    "torchvision",
    "numpy",
    "matplotlib",
    "PIL",
    "pytest",
    "tqdm",
    "cloudpickle",
    "pynvml",
    "timm",
    "tensorboard",
    "yaml",
    "jinja2",
    "packaging",
}
OWN = {"gpukit", "tests", "helpers", "fake_cuda", "cuda_guards", "gpu_lines", "open_in", "fit_overhead"}
# Imported only by tests that skip without them, each with its reason (a browser, a Jupyter server, a graph library).
OPTIONAL = {"playwright", "jupyter_server", "tomli", "torch_geometric"}
DISTRIBUTION = {"IPython": "ipython", "bs4": "beautifulsoup4"}


def test_the_wheel_list_carries_every_module_the_gpu_machine_lacks():
    listed = {
        name.lower().replace("-", "_")
        for line in (REPO_ROOT / "tools" / "gpu-wheels.txt").read_text().splitlines()
        for name in line.split("#")[0].split()
    }
    needed = _module_names_imported() - IN_THE_IMAGE - OWN - OPTIONAL
    missing = {name for name in needed if DISTRIBUTION.get(name, name).lower() not in listed}
    assert not missing, f"add to tools/gpu-wheels.txt (or to IN_THE_IMAGE if the GPU image has them): {missing}"
    assert {"nbconvert", "torchao", "nbval", "ipykernel"} <= listed


def test_a_git_that_does_not_answer_is_an_error_not_every_item_due(tmp_path, monkeypatch):
    # Under load a `git diff` once passed its limit and every item was planned as "commit not in this clone".
    def slow(*args, **kwargs):
        raise subprocess.TimeoutExpired(args[0], kwargs.get("timeout"))

    monkeypatch.setattr(gpuledger.subprocess, "run", slow)
    with pytest.raises(RuntimeError, match="took over .* the plan cannot tell what changed"):
        gpuledger.changed_files(tmp_path, "0" * 40)
