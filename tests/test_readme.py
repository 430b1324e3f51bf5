"""The README's recipes for your own notebook run as written (on the CPU, at the sizes they show), so they cannot rot.

Each block is found by a line it holds, in the section "Use gpukit in your own notebook", and runs in one namespace
with `gk`, `torch` and `env` (whose device is the CPU: the test names its device) in a temporary folder.
"""

from __future__ import annotations

import re
import types
from pathlib import Path

import pytest
import torch

import gpukit as gk

ROOT = Path(__file__).resolve().parents[1]


def readme_block(holding: str) -> str:
    """The Python block of the README's "Use gpukit in your own notebook" section that holds `holding`."""
    text = (ROOT / "README.md").read_text()
    section = re.search(r"^## Use gpukit in your own notebook\n(.*?)^## ", text, re.S | re.M)[1]
    blocks = [block for block in re.findall(r"```python\n(.*?)```", section, re.S) if holding in block]
    assert len(blocks) == 1, f"the README's own-notebook section has {len(blocks)} python blocks with {holding!r}"
    return blocks[0]


@pytest.fixture
def namespace(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the blocks write runs/... relative to the notebook's folder
    return {"gk": gk, "torch": torch, "env": types.SimpleNamespace(device="cpu")}


def test_the_resume_recipe_runs_and_the_second_call_goes_on_from_the_save(namespace, tmp_path):
    source = readme_block("save_every=")
    exec(compile(source.split("history = train_shapes()")[0], "README.md", "exec"), namespace)
    first = namespace["train_shapes"]()
    saved = sorted(path.name for path in (tmp_path / "runs").rglob("*.pt"))
    assert saved, "the recipe's checkpoint_dir holds no save"
    exec(compile(source, "README.md", "exec"), namespace)  # the block as written: both calls
    resumed = namespace["history"]
    assert [row["loss"] for row in resumed.steps] == [row["loss"] for row in first.steps]  # the finished run's


def test_the_memory_estimate_with_activation_checkpointing_runs_and_predicts_less(namespace, capsys):
    exec(compile(readme_block("apply_activation_checkpointing(model)"), "README.md", "exec"), namespace)
    plain, checked = namespace["plain"], namespace["checked"]
    assert checked.activations < plain.activations and checked.total < plain.total, (plain, checked)
    assert "with activation checkpointing" in capsys.readouterr().out
