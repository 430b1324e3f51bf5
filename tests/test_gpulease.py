"""`gpu-check --budget` and `--collect` (gpukit/gpulease.py) and tools/gpu_lease.sh, without a GPU: items replaced by
made-up results or by tiny real commands, the GPU and the pre-flight faked where a GPU would answer, the lease
script run with a fake python3. The cut tests kill a real check at seeded random moments."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path

import pytest

from gpukit import cli, gpucheck, gpulease, gpuledger
from gpukit.gpucheck import StepResult

REPO_ROOT = Path(__file__).resolve().parents[1]
H200 = gpucheck.Machine(["NVIDIA H200"], "580.159", "13.0", "2.11.0+cu130", "3.12.3", None, "2026-12-01")
READY = {
    "torch": "2.11.0+cu130",
    "cuda_build": "13.0",
    "cuda_available": True,
    "gpu": "NVIDIA H200",
    "gpu_memory": 150_000_000_000,
    "nbval": "0.11.0",
    "torchao": "0.18.0",
}
BENCHMARK = """import json, os, sys, time
open(os.path.join({pids!r}, os.path.basename(sys.argv[0])), "w").write(str(os.getpid()))
time.sleep({seconds})
json.dump({{"tables": []}}, open(sys.argv[sys.argv.index("--json") + 1], "w"))
"""


def made_up_entry(status: str | None, seconds: float) -> dict:
    entry = {"seconds": seconds, "seconds_from": "made up"}
    if status:
        entry["last_run"] = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11", "commit": "old", "date": "2026-11-24"}
        entry["last_run"] |= {"status": status, "seconds": seconds, "detail": ""}
    return entry


def checkout(tmp_path: Path, benchmarks: dict[str, float], ledger: dict | None = None) -> Path:
    """A checkout whose items are benchmarks that sleep the given seconds (each writes its pid to pids/ first)."""
    root = tmp_path / "checkout"
    for folder in ("tests", "notebooks", "benchmarks", "gpukit", "pids"):
        (root / folder).mkdir(parents=True, exist_ok=True)
    (root / "gpukit" / "__init__.py").write_text("")
    for name, seconds in benchmarks.items():
        (root / "benchmarks" / f"{name}.py").write_text(BENCHMARK.format(pids=str(root / "pids"), seconds=seconds))
    items = {f"benchmarks/{name}.py": made_up_entry(None, 1) for name in benchmarks}
    gpuledger.save_ledger(root / gpuledger.LEDGER_PATH, ledger or {"items": items})
    return root


def fake_gpu(monkeypatch, root: Path, facts: dict = READY) -> None:
    monkeypatch.setattr(gpucheck, "repository_root", lambda: root)
    monkeypatch.setattr(gpucheck, "no_gpu_message", lambda: None)
    monkeypatch.setattr(gpucheck, "describe_machine", lambda root: gpucheck.Machine(**vars(H200)))
    monkeypatch.setattr(gpulease, "preflight_facts", lambda root, logs: dict(facts))
    monkeypatch.setattr(gpulease, "find_identity", lambda root, ledger: gpulease.Identity("abc", set(), {}, "test"))


# ---------------------------------------------------------------------------------------------
# The command's own inputs: refused before any work


@pytest.mark.parametrize("budget", ["nan", "inf", "-inf", "0", "-5", "44"])
def test_a_budget_that_is_no_finite_number_of_seconds_is_refused_before_anything_runs(budget, monkeypatch, capsys):
    monkeypatch.setattr(gpucheck, "repository_root", lambda: pytest.fail("work started"))
    for dry_run in ([], ["--dry-run"]):
        assert cli.main(["gpu-check", f"--budget={budget}", *dry_run]) == cli.EXIT_BAD_INPUT
        err = capsys.readouterr().err
        assert f"--budget must be a number of seconds above {gpulease.own_seconds()}" in err and budget in err


@pytest.mark.parametrize(
    "arguments",
    [
        ["--dry-run"],
        ["--out", "x"],
        ["--leases", "3"],
        ["--collect", "x", "--budget", "480"],
        ["--collect", "x", "--dry-run"],
    ],
)
def test_options_that_need_budget_or_forbid_it_are_refused_before_anything_runs(arguments, monkeypatch, capsys):
    """--dry-run without --budget started the whole 29-minute check; now it and its company are refused."""
    for name in ("run_gpu_check", "repository_root", "no_gpu_message"):
        monkeypatch.setattr(gpucheck, name, lambda *args, **kwargs: pytest.fail("work started"))
    assert cli.main(["gpu-check", *arguments]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("gpukit: error: gpu-check --") and ("give --budget" in err or "runs nothing" in err)


# ---------------------------------------------------------------------------------------------
# A budgeted run with made-up items


def test_a_budgeted_run_writes_every_item_to_out_as_it_ends(monkeypatch, tmp_path, capsys):
    """b1 passes in 100 s (2 s planned); b2 runs to its overrun limit and is cut there, which is no failure of its
    own: its seconds become a lower bound and it stays as due as it was; b3 (188 s planned) is never started."""
    root = checkout(tmp_path, {"b1": 0, "b2": 0, "b3": 0})
    ledger = gpuledger.load_ledger(root / gpuledger.LEDGER_PATH)
    ledger["items"]["benchmarks/b3.py"]["seconds"] = 150  # planned 188 s: does not fit after b1 and b2 ran over
    gpuledger.save_ledger(root / gpuledger.LEDGER_PATH, ledger)
    fake_gpu(monkeypatch, root)
    clock, out, ran = [0.0], tmp_path / "out", []
    monkeypatch.setattr(gpulease.time, "monotonic", lambda: clock[0])

    def run_item(root, logs, item, limit):
        if ran:  # each item finds every earlier one already in --out
            assert gpuledger.load_ledger(out / "gpu-ledger.json")["items"][ran[-1][0]]["last_run"]["status"] == "pass"
            assert f"`{gpuledger.item_name(ran[-1][0])}.py`: pass" in (out / "results.md").read_text()
        ran.append((item, round(limit)))
        (logs / f"{gpuledger.item_name(item)}.log").write_text("ran\n")
        seconds, status = (100, "pass") if not ran[1:] else (limit, "timeout")
        clock[0] += seconds
        return StepResult("benchmark", gpuledger.item_name(item), status, seconds, "ok")

    monkeypatch.setattr(gpulease, "run_item", run_item)
    logs = tmp_path / "logs"
    assert cli.main(["gpu-check", "--budget", "300", "--out", str(out), "--log-dir", str(logs)]) == gpucheck.EXIT_FAILED
    cap = gpulease.item_cap(2)
    assert cap == 2 + gpulease.OVERRUN_SECONDS and ran == [("benchmarks/b1.py", cap), ("benchmarks/b2.py", cap)]
    text, left = capsys.readouterr().out, 300 - gpulease.OWN_SECONDS["writing"] - 100 - cap
    assert f"188 s planned, {left} s were left" in text and "not started" in text
    assert sorted(path.name for path in out.iterdir()) == sorted(gpulease.OUT_FILES)
    section = (out / "results.md").read_text()
    assert gpulease.section_id(section) and "Cut:" not in section and "`b3.py`: not started" in section
    assert f"cut at its overrun limit (2 s planned) ({cap} s)" in section
    cut = gpuledger.load_ledger(out / "gpu-ledger.json")["items"]["benchmarks/b2.py"]
    assert "last_run" not in cut and cut["seconds"] == cap and cut["seconds_from"].startswith("lower bound: stopped")
    with tarfile.open(out / "logs.tar.gz") as archive:
        assert {"logs/b1.log", "logs/b2.log"} <= set(archive.getnames())
    assert (out / "preflight.txt").read_text().splitlines()[-1] == "pre-flight: commit abc (test)"


def test_without_out_the_check_collects_its_own_folder(monkeypatch, tmp_path, capsys):
    root = checkout(tmp_path, {"b1": 0})
    fake_gpu(monkeypatch, root)
    monkeypatch.setattr(
        gpulease, "run_item", lambda root, logs, item, limit: StepResult("benchmark", "b1", "pass", 3, "ok")
    )
    results, logs = tmp_path / "R.md", tmp_path / "logs"
    assert cli.main(["gpu-check", "--budget", "300", "--results", str(results), "--log-dir", str(logs)]) == 0
    assert "`b1.py`: pass" in results.read_text() and (logs / "results.md").is_file()
    assert (
        gpuledger.load_ledger(root / gpuledger.LEDGER_PATH)["items"]["benchmarks/b1.py"]["last_run"]["commit"] == "abc"
    )
    assert capsys.readouterr().out.splitlines()[-1].startswith(f"section added to {results}; 1 items")


def test_the_logs_archive_leaves_the_lessons_out_rather_than_pass_what_comes_back(monkeypatch, tmp_path):
    logs = tmp_path / "logs"
    (logs / "notebooks").mkdir(parents=True)
    (logs / "b1.log").write_text("ran\n")
    (logs / "notebooks" / "10_x.ipynb").write_bytes(random.Random(0).randbytes(300_000))  # figures do not compress
    gpulease._archive(logs, tmp_path / "all.tar.gz")
    with tarfile.open(tmp_path / "all.tar.gz") as archive:
        assert "logs/notebooks/10_x.ipynb" in archive.getnames()
    monkeypatch.setattr(gpulease, "OUT_FILE_BYTES", 100_000)
    gpulease._archive(logs, tmp_path / "small.tar.gz")
    with tarfile.open(tmp_path / "small.tar.gz") as archive:
        assert archive.getnames() == ["logs", "logs/b1.log"]


def test_the_pre_flight_stops_at_once_naming_what_is_missing(monkeypatch, tmp_path, capsys):
    root = checkout(tmp_path, {"b1": 0})
    (root / "tests" / "test_fp8.py").write_text(
        "import pytest\nfrom gpukit import fp8\n\n@pytest.mark.gpu\ndef test_x():\n    pass\n"
    )
    fake_gpu(
        monkeypatch, root, READY | {"torchao": None, "torchao_error": "ModuleNotFoundError: No module named 'torchao'"}
    )
    monkeypatch.setattr(gpulease, "run_item", lambda *args: pytest.fail("an item ran"))
    out = tmp_path / "out"
    assert cli.main(["gpu-check", "--budget", "300", "--out", str(out), "--log-dir", str(tmp_path / "l")]) == 5
    err = capsys.readouterr().err
    assert (
        err
        == "gpu-check: torchao does not import (ModuleNotFoundError: No module named 'torchao'): carry its wheels (.whl). Nothing was run.\n"
    )
    assert (out / "preflight.txt").read_text().splitlines()[-1].startswith("pre-flight: stopped: torchao does not")
    assert not (out / "results.md").exists()


def test_pre_flight_lines_check_each_fact():
    identity = gpulease.Identity("0123456789ab", {"gpukit/x.py"}, {}, ".whl/lease.json, written today")
    lines, problem = gpulease.preflight_lines(READY, identity, {"nbval", "torchao"})
    assert problem is None and lines == [
        "torch 2.11.0+cu130, built for CUDA 13.0",
        "GPU: NVIDIA H200, 139.7 GiB",
        "nbval: 0.11.0",
        "torchao: 0.18.0",
        "commit 0123456789ab (.whl/lease.json, written today; 1 files differ from it)",
    ]
    cpu = READY | {"cuda_build": None, "cuda_available": False}
    assert gpulease.preflight_lines(cpu, identity, set())[1] == "torch 2.11.0+cu130 is a CPU-only build"
    hidden = READY | {"cuda_available": False}
    assert gpulease.preflight_lines(hidden, identity, set())[1] == "torch sees no CUDA GPU in the items' environment"
    no_nbval = READY | {"nbval": None, "nbval_error": "ImportError: coverage"}
    assert gpulease.preflight_lines(no_nbval, identity, {"torchao"})[1] is None  # no lesson planned: not needed
    assert gpulease.preflight_lines(no_nbval, identity, {"nbval"})[1].startswith("nbval does not import")
    assert gpulease.preflight_lines({"error": "Segmentation fault"}, identity, set())[1].endswith("Segmentation fault")


@pytest.mark.slow
def test_the_pre_flight_child_reads_the_items_environment(tmp_path):
    """The real child process, on this machine: torch's own version, no GPU, nbval and torchao as installed here."""
    import torch

    facts = gpulease.preflight_facts(REPO_ROOT, tmp_path)
    assert facts["torch"] == torch.__version__ and facts["cuda_available"] == torch.cuda.is_available()
    assert facts["nbval"] and ("torchao" in facts)


# ---------------------------------------------------------------------------------------------
# The commit: from git, or from the lease file written before the call


def git(root: Path, *args: str) -> str:
    command = ["git", "-c", "user.email=t@t", "-c", "user.name=t", *args]
    return subprocess.run(command, cwd=root, check=True, capture_output=True, text=True, timeout=60).stdout


def test_the_lease_file_carries_the_commit_to_a_copy_without_git(tmp_path):
    root = checkout(tmp_path, {"b1": 0})
    (root / ".gitignore").write_text(".whl/\n")
    git(root, "init", "-q")
    git(root, "add", ".")
    git(root, "commit", "-qm", "first")
    head = git(root, "rev-parse", "HEAD").strip()
    (root / "benchmarks" / "b1.py").write_text("print('changed, not committed')\n")
    gpulease.write_lease_file(root)
    ledger = gpuledger.load_ledger(root / gpuledger.LEDGER_PATH)
    here = gpulease.find_identity(root, ledger)
    assert (here.commit, here.source, here.changed) == (head[:12], "git", {"benchmarks/b1.py"})
    subprocess.run(["rm", "-rf", str(root / ".git")], check=True, timeout=60)  # as the device's copy
    there = gpulease.find_identity(root, ledger)
    assert there.commit == head[:12] and there.source.startswith(".whl/lease.json, written ")
    assert there.commit_for(["benchmarks/b1.py"]) == gpuledger.UNKNOWN  # not the commit's file: stays due
    assert there.commit_for(["gpukit/__init__.py"]) == head[:12]
    (root / "gpukit" / "__init__.py").write_text("# edited after the lease file was written\n")
    with pytest.raises(ValueError, match="describes other files than this copy's"):
        gpulease.find_identity(root, ledger)
    (root / ".whl" / "lease.json").write_text("{")
    with pytest.raises(ValueError, match="cannot be read.*prepare again"):
        gpulease.find_identity(root, ledger)
    (root / ".whl" / "lease.json").unlink()
    with pytest.raises(ValueError, match="no usable .git and no .whl/lease.json; run bash tools/gpu_lease.sh prepare"):
        gpulease.find_identity(root, ledger)


def test_the_first_lease_on_an_h200_runs_what_never_ran_first_and_fits():
    """The committed ledger, planned as tools/gpu_lease.sh prepare plans it (its default TOTAL, the set-up it
    plans, Python's start): the items that never ran on any GPU come first, and the plan fits the lease."""
    script = (REPO_ROOT / "tools" / "gpu_lease.sh").read_text()
    constant = {name: int(script.split(f"\n{name}=")[1].split()[0]) for name in ("SETUP_PLANNED", "PYTHON_START")}
    total = int(script.split("total=${2:-")[1].split("}")[0])
    budget = total - constant["SETUP_PLANNED"] - constant["PYTHON_START"] - gpulease.own_seconds()
    ledger = gpuledger.load_ledger(REPO_ROOT / gpuledger.LEDGER_PATH)
    items = gpuledger.gpu_items(REPO_ROOT)
    deps = {item: gpuledger.dependencies(REPO_ROOT, item) for item in items}
    plan = gpuledger.pack(gpuledger.candidates(ledger, deps, {}, gpu="NVIDIA H200"), budget)
    never = {item for item in items if not ledger["items"][item].get("last_run")}
    assert never == {
        "notebooks/10_what_practitioners_use.ipynb",
        "notebooks/06b_a_small_gpt_on_text.ipynb",
        "tests/test_fp8.py",
        "benchmarks/peers.py",
    }
    assert {c.item for c in plan.chosen[: len(never)]} == never and plan.seconds <= budget


# ---------------------------------------------------------------------------------------------
# --collect: checked before anything changes, and idempotent


def collected(tmp_path: Path, root: Path, out: Path, monkeypatch) -> tuple[str, dict]:
    monkeypatch.setattr(gpucheck, "repository_root", lambda: root)
    assert cli.main(["gpu-check", "--collect", str(out), "--results", str(tmp_path / "R.md")]) == 0
    return (tmp_path / "R.md").read_text(), gpuledger.load_ledger(root / gpuledger.LEDGER_PATH)


def made_up_run(tmp_path: Path, root: Path, results: list[StepResult], plan_items: list[str]) -> gpulease.Run:
    plan = gpuledger.Plan(300, [gpuledger.Candidate(item, 0, "", 10, "") for item in plan_items])
    ledger = gpuledger.load_ledger(root / gpuledger.LEDGER_PATH)
    logs = tmp_path / "logs"
    logs.mkdir(exist_ok=True)
    run = gpulease.Run("2026-12-01T10:00:00+00:00", root, H200, plan, 300, tmp_path / "out", logs, ledger)
    for result in results:
        item = f"benchmarks/{result.name}.py"
        gpuledger.record(ledger, item, result.status, 5, "", run.identity("abc"), [item])
        run.results.append(result)
    return run


def test_collecting_a_cut_run_then_the_whole_one_changes_results_once(monkeypatch, tmp_path, capsys):
    root = checkout(tmp_path, {"b1": 0, "b2": 0})
    (tmp_path / "R.md").write_text("# Measured results\n\n## CPU: earlier\n")
    run = made_up_run(
        tmp_path, root, [StepResult("benchmark", "b1", "pass", 5, "ok")], ["benchmarks/b1.py", "benchmarks/b2.py"]
    )
    run.write()  # as a cut leaves it: b1 done, b2 not
    text, ledger = collected(tmp_path, root, run.out, monkeypatch)
    assert (
        "Cut: the check stopped before b2" in text
        and ledger["items"]["benchmarks/b1.py"]["last_run"]["status"] == "pass"
    )
    assert "section added to" in capsys.readouterr().out
    assert collected(tmp_path, root, run.out, monkeypatch)[0] == text  # again: nothing changes
    assert "section unchanged in" in capsys.readouterr().out
    run.results.append(StepResult("benchmark", "b2", "fail", 5, "boom"))
    gpuledger.record(run.ledger, "benchmarks/b2.py", "fail", 5, "boom", run.identity("abc"), ["benchmarks/b2.py"])
    run.write(finished=True)
    text, ledger = collected(tmp_path, root, run.out, monkeypatch)
    assert (
        text.count("## GPU: NVIDIA H200") == 1
        and "Cut:" not in text
        and text.startswith("# Measured results\n\n## CPU")
    )
    assert (
        ledger["items"]["benchmarks/b2.py"]["last_run"]["status"] == "fail" and "replaced in" in capsys.readouterr().out
    )


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ({"gpu-ledger.json": '{"items": {'}, "gpu-ledger.json is damaged \\(not JSON"),
        ({"gpu-ledger.json": '{"items": []}'}, 'gpu-ledger.json is damaged \\(no "items" object\\)'),
        (
            {"gpu-ledger.json": json.dumps({"items": {"b": {"seconds": 1, "last_run": {"status": "ok"}}}})},
            "has no gpu or date",
        ),
        ({"results.md": "## GPU: made by hand\n"}, "results.md is damaged"),
        ({"results.md": None}, "has no results.md: the check stopped before its first item \\(pre-flight: stopped"),
    ],
)
def test_collect_reads_and_checks_the_folder_before_it_changes_anything(damage, message, monkeypatch, tmp_path, capsys):
    root = checkout(tmp_path, {"b1": 0})
    run = made_up_run(tmp_path, root, [StepResult("benchmark", "b1", "pass", 5, "ok")], ["benchmarks/b1.py"])
    run.write(finished=True)
    (run.out / "preflight.txt").write_text("pre-flight: stopped: torch sees no CUDA GPU\n")
    for name, text in damage.items():
        (run.out / name).unlink() if text is None else (run.out / name).write_text(text)
    (tmp_path / "R.md").write_text("# Measured results\n")
    ledger_before = (root / gpuledger.LEDGER_PATH).read_bytes()
    monkeypatch.setattr(gpucheck, "repository_root", lambda: root)
    assert cli.main(["gpu-check", "--collect", str(run.out), "--results", str(tmp_path / "R.md")]) == cli.EXIT_BAD_INPUT
    err = capsys.readouterr().err
    assert err.startswith("gpukit: error: gpu-check --collect: ") and len(err.splitlines()) == 1
    assert __import__("re").search(message, err), err
    assert (tmp_path / "R.md").read_text() == "# Measured results\n"  # untouched
    assert (root / gpuledger.LEDGER_PATH).read_bytes() == ledger_before


# ---------------------------------------------------------------------------------------------
# Cut at any second: a real check, its items tiny real commands, killed at random moments


DRIVER = """import sys
from pathlib import Path
from gpukit import cli, gpucheck, gpulease
root = Path(sys.argv[1])
gpucheck.repository_root = lambda: root
gpucheck.no_gpu_message = lambda: None
gpucheck.describe_machine = lambda root: gpucheck.Machine(["NVIDIA H200"], "580", "13.0", "2.11", "3.12", None, "2026-12-01")
gpulease.preflight_facts = lambda root, logs: {facts!r}
gpulease.find_identity = lambda root, ledger: gpulease.Identity("abc", set(), {{}}, "test")
sys.exit(cli.main(["gpu-check", "--budget", "300", "--out", sys.argv[2], "--log-dir", sys.argv[3]]))
"""


def start_check(tmp_path: Path, root: Path, run: int) -> tuple[subprocess.Popen, list[str], threading.Event]:
    """The check in a process of its own; its output lines as they come, and an event set at its plan's line."""
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]))
    out, logs = tmp_path / f"out{run}", tmp_path / f"logs{run}"
    command = [sys.executable, "-c", DRIVER.format(facts=READY), str(root), str(out), str(logs)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=environment, start_new_session=True)
    lines, planned = [], threading.Event()

    def read():
        for line in process.stdout:
            lines.append(line)
            planned.set() if line.startswith("pre-flight: commit") else None

    threading.Thread(target=read, daemon=True).start()
    return process, lines, planned


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def finished_items(lines: list[str]) -> list[str]:
    """The items whose result line the check printed (it prints one after writing the item to --out)."""
    return sorted({line.split()[1] for line in lines if line.startswith("benchmark ") and " pass " in line})


@pytest.mark.slow
@pytest.mark.skipif(sys.platform != "linux", reason="the item's death with the check (PR_SET_PDEATHSIG) is Linux's")
def test_a_check_killed_at_random_moments_keeps_every_finished_item_mergeable(monkeypatch, tmp_path):
    names = [f"b{n}" for n in range(6)]
    root = checkout(tmp_path, dict.fromkeys(names, 0.4))
    draw = random.Random(43)
    for run in range(3):
        process, lines, planned = start_check(tmp_path, root, run)
        assert planned.wait(120), "".join(lines)
        time.sleep(draw.uniform(1.2 * run, 1.2 * run + 1.2))  # one cut early, one mid-run, one late: 6 items of ~0.6 s
        os.kill(process.pid, signal.SIGKILL)  # no handler can run: what is in out/ is all there is
        process.wait(30)
        time.sleep(0.5)  # the reader thread takes the last lines
        done = finished_items(lines)
        out = tmp_path / f"out{run}"
        if not (out / "results.md").exists():
            assert not done
            continue
        ledger = gpuledger.load_ledger(out / "gpu-ledger.json")
        assert {f"benchmarks/{name}.py" for name in done} <= {
            item for item, entry in ledger["items"].items() if (entry.get("last_run") or {}).get("status") == "pass"
        }
        running = [name for name in names if name not in done and (root / "pids" / name).exists()]
        for name in running:  # the item running at the kill died with the check
            pid = int((root / "pids" / name).read_text())
            deadline = time.monotonic() + 5
            while _alive(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _alive(pid), name
        text, merged = collected(tmp_path, root, out, monkeypatch)
        assert all(f"`{name}.py`: pass" in text for name in done)
        assert collected(tmp_path, root, out, monkeypatch) == (text, merged)  # twice: the same
        for pid_file in (root / "pids").iterdir():
            pid_file.unlink()
        print(f"cut {run}: {len(done)} items finished")


@pytest.mark.slow
def test_sigterm_stops_the_running_item_with_its_processes_and_writes_it_as_cut(tmp_path):
    root = checkout(tmp_path, {"a_quick": 0.1, "b_hangs": 60, "c_never": 0.1})
    process, lines, planned = start_check(tmp_path, root, 0)
    pid_file = root / "pids" / "b_hangs.py"
    deadline = time.monotonic() + 120
    while not pid_file.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    item = int(pid_file.read_text())
    time.sleep(1.5)  # longer than the 1 s the ledger had: the cut's lower bound is news
    process.send_signal(signal.SIGTERM)
    assert process.wait(30) == 128 + signal.SIGTERM
    assert not _alive(item)
    out = tmp_path / "out0"
    section = (out / "results.md").read_text()
    assert "`b_hangs.py`: timeout" in section and "the check was stopped (SIGTERM)" in section
    assert "Cut: the check stopped before c_never" in section
    entry = gpuledger.load_ledger(out / "gpu-ledger.json")["items"]["benchmarks/b_hangs.py"]
    assert "last_run" not in entry and entry["seconds_from"].startswith("lower bound: the check was stopped")


# ---------------------------------------------------------------------------------------------
# tools/gpu_lease.sh: its deadline arithmetic, with a fake python3


FAKE_PYTHON = """#!/usr/bin/env bash
# pip: sleeps FAKE_PIP_SECONDS, exits FAKE_PIP_CODE; anything else: records its arguments, then sleeps or not
if [[ "$*" == *" pip install "* ]]; then sleep "${FAKE_PIP_SECONDS:-0}"; exit "${FAKE_PIP_CODE:-0}"; fi
echo "$@" > "$FAKE_CALLS/python3"
trap 'echo TERM > "$FAKE_CALLS/term"; exit 143' TERM
sleep "${FAKE_CHECK_SECONDS:-0}" & wait
"""
FAKE_TIMEOUT = """#!/usr/bin/env bash
echo "$@" > "$FAKE_CALLS/timeout"
exec "$REAL_TIMEOUT" "$@"
"""


def lease(tmp_path: Path, *arguments: str, **variables: str) -> tuple[subprocess.CompletedProcess, Path]:
    """tools/gpu_lease.sh in a copy of the checkout's tools/ with .whl/, its python3 and timeout fake."""
    root, bin_, calls = tmp_path / "checkout", tmp_path / "bin", tmp_path / "calls"
    for folder in (root / "tools", root / ".whl", bin_, calls):
        folder.mkdir(parents=True, exist_ok=True)
    (root / "tools" / "gpu_lease.sh").write_text((REPO_ROOT / "tools" / "gpu_lease.sh").read_text())
    (root / ".whl" / "x-1-py3-none-any.whl").write_text("")
    (root / ".whl" / "lease.json").write_text("{}")
    for name, text in (("python3", FAKE_PYTHON), ("timeout", FAKE_TIMEOUT)):
        (bin_ / name).write_text(text)
        (bin_ / name).chmod(0o755)
    real_timeout = subprocess.run(["which", "timeout"], capture_output=True, text=True, check=True).stdout.strip()
    environment = dict(os.environ, PATH=f"{bin_}:{os.environ['PATH']}", FAKE_CALLS=str(calls))
    environment |= {"REAL_TIMEOUT": real_timeout, "OUT": str(tmp_path / "OUT"), **variables}
    command = ["bash", str(root / "tools" / "gpu_lease.sh"), *arguments]
    return subprocess.run(command, capture_output=True, text=True, env=environment, timeout=120), calls


def test_the_lease_script_gives_gpu_check_what_its_set_up_left_of_the_total(tmp_path):
    script = (REPO_ROOT / "tools" / "gpu_lease.sh").read_text()
    grace, start = (int(script.split(f"\n{name}=")[1].split()[0]) for name in ("KILL_GRACE", "PYTHON_START"))
    done, calls = lease(tmp_path, "200", FAKE_PIP_SECONDS="2")
    assert done.returncode == 0, done.stderr
    timeout_args = (calls / "timeout").read_text().split()
    left = int(timeout_args[2])
    assert timeout_args[:2] == ["--signal=TERM", f"--kill-after={grace}"] and 197 <= left <= 198  # 200 - 2 s set-up
    check = (calls / "python3").read_text().split()
    assert check[:5] == ["-m", "gpukit", "gpu-check", "--budget", str(left - start)]
    assert left + grace <= 200 + grace  # the whole command: set-up + left + grace = total + grace
    default = int(script.split("total=${1:-")[1].split("}")[0])
    assert default + grace <= 600 - 30  # the device stops a command at 600 s; 30 s for the files to come back
    assert 240 + default + grace + 30 <= 15 * 60  # a start of 4 min, the command, the files: one lease


def test_the_lease_script_stops_at_a_failed_install_and_where_set_up_left_too_little(tmp_path):
    done, calls = lease(tmp_path, "200", FAKE_PIP_CODE="1")
    assert done.returncode == 6 and "installing the wheels failed" in done.stderr and not (calls / "python3").exists()
    done, calls = lease(tmp_path, "137", FAKE_PIP_SECONDS="3")
    assert done.returncode == 6 and "120 at least" in done.stderr  # 137 - 3 - 15 < 120: nothing is started
    assert not (calls / "python3").exists()


def test_the_lease_script_prepares_here_with_the_budget_the_device_will_have(tmp_path):
    done, calls = lease(tmp_path, "prepare", "540", PYTHON="python3")
    assert done.returncode == 0, done.stderr
    script = (REPO_ROOT / "tools" / "gpu_lease.sh").read_text()
    setup, start = (int(script.split(f"\n{name}=")[1].split()[0]) for name in ("SETUP_PLANNED", "PYTHON_START"))
    assert (calls / "python3").read_text().split() == [
        "-m",
        "gpukit.gpulease",
        "prepare",
        "--budget",
        str(540 - setup - start),
        "--gpu",
        "NVIDIA",
        "H200",
    ]
