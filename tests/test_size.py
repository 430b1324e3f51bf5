"""The package's size, recorded so that its next growth is a decision, not an accident (issue 46).

- Lines per folder of gpukit/ (a folder's own .py files, not its subfolders'), each within a budget: today's count
  (2026-11-29) with about 5% room. A change that needs more raises the budget here, in the same commit, and says why.
- The learner's core: following fit to optimizer.step crosses three files (gpukit/train/loop.py,
  gpukit/step/train_step.py, gpukit/precision.py), at most 700 lines in all, and the step's own definitions within them
  at most 300 lines.
- No module a learner reads over 400 lines: the modules over 400 lines today, all in the commands' wing, which no
  learner module imports, are listed with their length, which may only shrink.
"""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "gpukit"

# folder: (lines on 2026-11-29, the budget). The modules split to at most 400 lines that day (issue 46) grew by their
# new files' docstrings, imports and __all__: 483 lines in all, said per folder.
BUDGET = {
    "gpukit": (3167, 3330),  # the leaves and small modules; checkup, env and fp8 became packages
    "gpukit/checkup": (786, 830),  # gk.doctor: checkup.py (709) split by topic
    "gpukit/commands": (3005, 3150),  # the shell's wing: gpu-check, its lease plans, the site, JupyterLab's hooks
    "gpukit/data": (3091, 3250),  # +54 for loader_timing.py (bottleneck.py split)
    "gpukit/distributed": (2165, 2280),  # +109 for process_group, launch_worker, launch_watch
    "gpukit/env": (627, 660),  # detection, profiles, the GPU survey: env.py (569) split
    "gpukit/fp8": (450, 480),  # casts, FP8 training, speed: fp8.py (410) split
    "gpukit/hardware": (1445, 1520),  # +60 for roofline.py and calibration.py
    "gpukit/memory": (2882, 3030),  # +85 for measured_step, recomputation, blocks
    "gpukit/practice": (3310, 3480),  # the lessons' exercises: mostly their prompts, solutions and wrong answers
    # +102: gk.CrossEntropy (fit's label_smoothing as a loss object: 24 parameters), and builtin_losses.py split from
    # losses.py to keep it under 400 lines (its docstring and imports)
    "gpukit/step": (1045, 1100),
    # +540 in all: issue 47 (the epoch read again after a NaN the last batch does not show; SIGTERM saved at a step;
    # batches that cannot be read: meta, collate, a graph), issue 48 (a dict of losses, buffers put back for QAT);
    # +20: issue 45, lr_find says when its sweep never saw the loss rise (LRFinderResult.rose and a warning)
    "gpukit/train": (3941, 4500),
}

# The files a reader opens to follow one step, in reading order, and the definitions that are the step.
CORE = ["train/loop.py", "step/train_step.py", "precision.py"]
STEP = {
    "train/loop.py": ["fit", "_train", "_train_epoch", "_train_on", "_micro_step", "_optimizer_step"],
    "step/train_step.py": ["TrainStep.__init__", "TrainStep.forward", "TrainStep.backward", "TrainStep.step"],
    "precision.py": ["Precision.__init__", "Precision.autocast", "Precision.backward", "Precision.step"],
}
# What the step calls and its setup and lifecycle: named at their calls, short enough to read whole when opened.
LEARNERS_MODULES = [
    *CORE,
    "step/batches.py",
    "step/outputs.py",
    "step/losses.py",
    "step/builtin_losses.py",
    "train/setup.py",
    "train/run.py",
    "train/options.py",
    "train/model_options.py",
    "train/log_window.py",
    "train/tally.py",
    "train/data.py",
    "train/evaluation.py",
    "train/history.py",
    "train/checks.py",
    "train/batch_checks.py",
    "train/checkpoint.py",
    "train/checkpoint_file.py",
    "train/saved_state.py",
    "optim.py",
]
LONGER = {  # modules over 400 lines today, all the shell's: their length may only shrink
    "commands/gpucheck.py": 691,
    "commands/gpulease.py": 615,
    "commands/gpuledger.py": 485,
    "commands/cli.py": 446,
}


def lines(path: Path) -> int:
    return len(path.read_text().splitlines())


def test_each_folder_keeps_within_its_budget():
    counted: dict[str, int] = {}
    for path in PACKAGE.rglob("*.py"):
        folder = path.parent.relative_to(PACKAGE.parent).as_posix()
        counted[folder] = counted.get(folder, 0) + lines(path)
    unbudgeted = sorted(set(counted) - set(BUDGET))
    assert not unbudgeted, f"{unbudgeted} have no budget: add them to BUDGET in tests/test_size.py, with their lines"
    over = {folder: (count, BUDGET[folder][1]) for folder, count in counted.items() if count > BUDGET[folder][1]}
    assert not over, f"over budget (lines, budget): {over}; raise the budget here if the growth is meant, saying why"


def definition_lines(path: Path, names: list[str]) -> int:
    """Lines of the functions or methods `names` ("Class.method") in `path`, decorators included."""
    tree, found = ast.parse(path.read_text()), {}
    for node in ast.walk(tree):
        owners = [node] if isinstance(node, ast.ClassDef) else []
        for owner in owners:
            for item in owner.body:
                if isinstance(item, ast.FunctionDef):
                    found[f"{owner.name}.{item.name}"] = item
        if isinstance(node, ast.FunctionDef) and node in tree.body:
            found[node.name] = node
    missing = [name for name in names if name not in found]
    assert not missing, f"{path.name} no longer defines {missing}: update STEP in tests/test_size.py"
    return sum(
        found[name].end_lineno - min([found[name].lineno, *(d.lineno for d in found[name].decorator_list)]) + 1
        for name in names
    )


def test_one_step_is_three_files_and_about_300_lines():
    assert sum(lines(PACKAGE / name) for name in CORE) <= 700
    step = sum(definition_lines(PACKAGE / name, names) for name, names in STEP.items())
    assert 150 <= step <= 300, f"the step from fit to optimizer.step is {step} lines"


def test_the_learners_modules_are_short_and_the_long_ones_only_shrink():
    long = {name: lines(PACKAGE / name) for name in LEARNERS_MODULES if lines(PACKAGE / name) > 400}
    assert not long, long
    grown = {
        path.relative_to(PACKAGE).as_posix(): lines(path)
        for path in PACKAGE.rglob("*.py")
        if lines(path) > LONGER.get(path.relative_to(PACKAGE).as_posix(), 400)
    }
    assert not grown, f"over 400 lines (or longer than LONGER says): {grown}"
