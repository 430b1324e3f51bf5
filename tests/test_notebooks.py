"""The committed notebooks follow the lesson rules. (Running them is nbval's job: `make test`.)"""

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpukit import site

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The kernel `make setup` installs; JupyterLab rewrites (and autosaves) a notebook whose kernelspec differs.
_DISPLAY_NAME = re.search(r"^KERNEL_DISPLAY_NAME := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
KERNELSPEC = {"display_name": _DISPLAY_NAME, "language": "python", "name": "python3"}


def test_notebooks_exist_in_reading_order():
    names = [path.stem for path in NOTEBOOKS]
    assert names[:3] == ["00_environment_and_cpu_vs_gpu", "01_train_a_cnn", "02_input_pipeline"]
    assert all(re.fullmatch(r"\d\d[a-z]?_[a-z0-9_]+", name) for name in names)  # 06b_…: a lesson put after 06


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_clean_and_runnable_everywhere(path):
    text = path.read_text()
    notebook = json.loads(text)
    # Written as Jupyter writes it (sorted keys, indent 1), so opening and saving a lesson changes nothing.
    assert text == json.dumps(notebook, indent=1, sort_keys=True, ensure_ascii=False) + "\n", (
        f"{path.name}: write it with json.dump(notebook, file, indent=1, sort_keys=True, ensure_ascii=False) + newline"
    )
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for cell in code_cells:
        assert cell.get("outputs") == [], f"{path.name}: clear the outputs before committing"
        assert cell.get("execution_count") is None, f"{path.name}: clear the execution counts before committing"
        source = "".join(cell["source"])
        assert not re.search(r"^\s*[!%]", source, re.MULTILINE), f"{path.name}: no shell or magic commands"
    ids = [cell.get("id") for cell in notebook["cells"]]
    # nbformat 4.5 gives every cell an id; JupyterLab adds any that is missing, marking the lesson modified.
    assert None not in ids and len(set(ids)) == len(ids), f"{path.name}: every cell needs its own id"
    assert notebook["metadata"]["kernelspec"] == KERNELSPEC, (
        f"{path.name}: a kernelspec other than `make setup` installs"
    )
    # The install cell (tools/open_in.py: a no-op where gpukit is installed), then the setup cell.
    assert code_cells[0].get("id") == "install-gpukit", f"{path.name}: run python tools/open_in.py"
    setup = "".join(code_cells[1]["source"])
    assert "gk.detect()" in setup and "seed_everything" in setup, f"{path.name}: the setup cell sets env and seed"
    # One thread policy for every lesson (gpukit.env.cpu_threads), applied where the reader sees it, said with its reason.
    assert "torch.set_num_threads(env.threads)" in setup and "env.threads_reason" in setup, (
        f"{path.name}: the setup cell applies and prints gk.detect()'s threads"
    )
    rest = "".join("".join(cell["source"]) for cell in code_cells[2:])
    assert not re.search(r"cpu_count <= 2:\s*\n\s*torch\.set_num_threads", rest), (
        f"{path.name}: a thread count chosen outside gpukit.env.cpu_threads"
    )


def sections(notebook: dict) -> list[tuple[str, list[dict]]]:
    """(heading, cells) of each `## ` section: from a markdown cell starting with `## ` up to the next one.
    The title and setup cells before the first one belong to no section."""
    found = []
    for cell in notebook["cells"]:
        source = "".join(cell["source"])
        if cell["cell_type"] == "markdown" and source.startswith("## "):
            found.append((source.splitlines()[0], []))
        elif found:
            found[-1][1].append(cell)
    return found


def asserts(node: ast.AST, branched: bool = False) -> Iterator[bool]:
    """For each assert statement or gk.check / gk.check_between call under `node`: whether it sits inside an `if`
    (a claim checked only sometimes)."""
    for child in ast.iter_child_nodes(node):
        if site.is_check_node(child) and not _is_skip(child):
            yield branched
        yield from asserts(child, branched or isinstance(child, ast.If))


def _is_skip(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) == "skip_check"


def is_check(cell: dict) -> bool:
    """A code cell that checks always, or only in a branch (a GPU-only claim) when it also says what it skipped
    otherwise (gk.skip_check, or a line "skipped: … needs a CUDA GPU"): never a claim dropped in silence."""
    if cell["cell_type"] != "code":
        return False
    source = "".join(cell["source"])
    branched = list(asserts(ast.parse(source)))
    return (False in branched) or (bool(branched) and ("skipped" in source or "skip_check(" in source))


def is_practice(cell: dict) -> bool:
    """A cell of a lesson's Practice section (gpukit.practice.cells): exercises the learner answers, checked by
    tests/test_practice.py, not claims the lesson makes."""
    return "exercise" in cell.get("metadata", {}).get("gpukit", {})


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_section_with_code_ends_with_a_check(path):
    # A lesson checks each result where it is measured: every `## ` section that runs code ends (its last code
    # cell) with an assert cell. Set-up sections use `###` headings inside the section that checks them.
    unchecked = [
        heading
        for heading, cells in sections(json.loads(path.read_text()))
        if (code := [cell for cell in cells if cell["cell_type"] == "code" and not is_practice(cell)])
        and not is_check(code[-1])
    ]
    assert not unchecked, (
        f"{path.name}: end these sections with an assert cell that checks what they measured: {unchecked}"
    )


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_every_temporary_folder_a_lesson_makes_is_removed_by_a_later_cell(path):
    """A lesson run leaves nothing in /tmp: each `name = Path(tempfile.mkdtemp(...))` has a later `shutil.rmtree(name`."""
    sources = ["".join(cell["source"]) for cell in json.loads(path.read_text())["cells"] if cell["cell_type"] == "code"]
    for index, source in enumerate(sources):
        for name in re.findall(r"^\s*(\w+) = Path\(tempfile\.mkdtemp\(", source, re.MULTILINE):
            later = "\n".join(sources[index + 1 :])
            assert f"shutil.rmtree({name}" in later, f"{path.name}: no later cell removes {name} (tempfile.mkdtemp)"
