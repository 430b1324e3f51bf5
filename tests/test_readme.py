"""The README as written: every python block runs, in order, as a learner pastes them into a notebook, and every
markdown table has the shape it says.

The blocks read their sizes from `gk.detect().profile`, so they run as written at any profile's sizes: here at a
profile smaller than `tiny` (SMALL: the tiny profile's CNN and GPT trained for a fraction of its steps), which the
test gives GPUKIT_PROFILE. At the tiny profile itself the first block alone took 7.5 minutes at a load of 11.

A block that cannot run here must say so in the README itself, on its first line: "# not run by tests/test_readme.py:
WHY" (a GPU, a network, a long run); its test is then skipped with that reason. Two recipes are also checked for what
they claim: a resumed run goes on from its save, and activation checkpointing lowers the memory predicted.
"""

from __future__ import annotations

import dataclasses
import re
import types
from pathlib import Path

import matplotlib.pyplot as plt
import pytest
import torch

import gpukit as gk
from gpukit import env as gpukit_env

ROOT = Path(__file__).resolve().parents[1]
NOT_RUN = re.compile(r"\A# not run by tests/test_readme\.py: (.+)$", re.M)
MARKDOWN = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def python_blocks() -> list[tuple[str, str]]:
    """(where, source) of every ```python block of the README, in order; where: "block N (its section)"."""
    text = (ROOT / "README.md").read_text()
    blocks = []
    for found in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        prose = re.sub(r"^```.*?^```", "", text[: found.start()], flags=re.S | re.M)  # a code comment is no heading
        sections = re.findall(r"^#+ (.+)$", prose, re.M)
        blocks.append((f"block {len(blocks) + 1} ({sections[-1] if sections else 'top'})", found[1]))
    return blocks


BLOCKS = python_blocks()
SMALL = dataclasses.replace(
    gpukit_env.PROFILES["tiny"],
    name="readme",
    train_size=1024,
    test_size=256,
    epochs=2,
    text_bytes=100_000,
    gpt_steps=30,
)


class Reader:
    """Runs the README's python blocks in order in one namespace, each once, whatever order the tests run in."""

    def __init__(self, folder: Path):
        self.folder, self.namespace, self.done, self.failed = folder, {"__name__": "__readme__"}, 0, None

    def run_through(self, index: int, monkeypatch) -> None:
        """Run every block up to `index` not run yet; fail if one of them (or an earlier one) failed."""
        monkeypatch.chdir(self.folder)  # the blocks write runs/... where they run
        monkeypatch.setitem(gpukit_env.PROFILES, SMALL.name, SMALL)  # the sizes the blocks read from env.profile
        monkeypatch.setenv("GPUKIT_PROFILE", SMALL.name)
        while self.done <= index:
            where, source = BLOCKS[self.done]
            self.done += 1
            if self.failed is None and not NOT_RUN.search(source):
                self._run(where, source)
        if self.failed is not None and not self.failed.startswith(BLOCKS[index][0]):
            raise AssertionError(f"an earlier block failed: {self.failed}")

    def _run(self, where: str, source: str) -> None:
        try:
            exec(compile(source, f"README.md, {where}", "exec"), self.namespace)
        except Exception as error:
            self.failed = f"{where} raised {type(error).__name__}: {error}"
            raise
        finally:
            plt.close("all")


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    threads = torch.get_num_threads()  # the first block sets env.threads for the blocks after it, as in a notebook
    yield Reader(tmp_path_factory.mktemp("readme"))
    torch.set_num_threads(threads)


def test_the_readme_has_python_blocks_to_run():
    assert len(BLOCKS) >= 5, [where for where, _ in BLOCKS]


@pytest.mark.timeout(600)  # the first block: seconds idle, a minute or two at a load of 10
@pytest.mark.parametrize("index", range(len(BLOCKS)), ids=[where for where, _ in BLOCKS])
def test_every_python_block_runs_as_written(reader, monkeypatch, index):
    said = NOT_RUN.search(BLOCKS[index][1])
    if said:
        pytest.skip(f"README.md, {BLOCKS[index][0]}: not run here: {said[1]}")
    reader.run_through(index, monkeypatch)


def table_rows(text: str) -> list[list[str]]:
    """Each markdown table outside code blocks, as its lines (header, delimiter, rows)."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return [block.strip().splitlines() for block in re.findall(r"(?:^\|.*\|[ \t]*\n?)+", text, re.M)]


def cells(line: str) -> int:
    """The cells of a table line as GitHub counts them: split at each `|` not escaped as `\\|`."""
    return len(re.split(r"(?<!\\)\|", line.strip().removeprefix("|").removesuffix("|")))


@pytest.mark.parametrize("path", MARKDOWN, ids=[path.name for path in MARKDOWN])
def test_every_table_has_as_many_cells_in_each_line_as_in_its_header(path):
    for table in table_rows(path.read_text()):
        assert len(table) >= 2 and re.fullmatch(r"\|?(\s*:?-+:?\s*\|)*\s*:?-+:?\s*\|?", table[1]), table[:2]
        widths = [cells(line) for line in table]
        wrong = [line for line, width in zip(table, widths) if width != widths[0]]
        assert not wrong, (
            f"{path.name}: a table whose header has {widths[0]} cells has lines with another count: {wrong}"
        )


def test_the_table_shape_check_sees_a_wrong_delimiter():
    assert [cells(line) for line in table_rows("| a | b |\n|---|---|---|\n| 1 | 2 |\n")[0]] == [2, 3, 2]
    assert table_rows("```\n| not | a table |\n```\n") == []


# ---------------------------------------------------------------------------------------------
# Two recipes, checked for what they claim (each block alone, with gk, torch and a CPU env given)


def readme_block(holding: str) -> str:
    """The one python block of the README that holds `holding`."""
    blocks = [source for _, source in BLOCKS if holding in source]
    assert len(blocks) == 1, f"the README has {len(blocks)} python blocks with {holding!r}"
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
