"""The committed notebooks follow the lesson rules. (Running them is nbval's job: `make test`.)"""

import json
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
# The kernel `make setup` installs; JupyterLab rewrites (and autosaves) a notebook whose kernelspec differs.
_DISPLAY_NAME = re.search(r"^KERNEL_DISPLAY_NAME := (.+)$", (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
KERNELSPEC = {"display_name": _DISPLAY_NAME, "language": "python", "name": "python3"}


def test_notebooks_exist_in_reading_order():
    names = [path.stem for path in NOTEBOOKS]
    assert names[:3] == ["00_environment_and_cpu_vs_gpu", "01_train_a_cnn", "02_input_pipeline_and_compile"]
    assert all(re.fullmatch(r"\d\d_[a-z0-9_]+", name) for name in names)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_committed_clean_and_runnable_everywhere(path):
    notebook = json.loads(path.read_text())
    code_cells = [cell for cell in notebook["cells"] if cell["cell_type"] == "code"]
    for cell in code_cells:
        assert cell.get("outputs") == [], f"{path.name}: clear the outputs before committing"
        assert cell.get("execution_count") is None, f"{path.name}: clear the execution counts before committing"
        source = "".join(cell["source"])
        assert not re.search(r"^\s*[!%]", source, re.MULTILINE), f"{path.name}: no shell or magic commands"
    assert notebook["metadata"]["kernelspec"] == KERNELSPEC, (
        f"{path.name}: a kernelspec other than `make setup` installs"
    )
    first = "".join(code_cells[0]["source"])
    assert "gk.detect()" in first and "seed_everything" in first, f"{path.name}: the first cell sets up env and seed"
    sources = "\n".join("".join(cell["source"]) for cell in code_cells)
    assert "assert " in sources, f"{path.name}: every lesson checks its claims"
