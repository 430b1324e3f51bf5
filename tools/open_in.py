"""Open every lesson in Colab or Kaggle: badges and a first cell that installs gpukit where it is missing.

Everything is built from one URL, `Repository` in pyproject.toml's [project.urls]: the badges at the top of
each lesson and in the README's lesson table, and the install cell's `pip install`. Run it after changing
that URL or adding a lesson; tests/test_open_in.py fails while anything is out of date.

    python tools/open_in.py          # rewrite the lessons and the README
    python tools/open_in.py --check  # exit 1 and name what is out of date
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import nbformat

try:
    import tomllib
except ImportError:  # Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
INSTALL_CELL_ID = "install-gpukit"
BADGES = "<!-- open-in -->"  # marks the badge line, so that it can be rewritten

# The cell is plain Python: it runs before gpukit exists. Pinning the installed torch and torchvision makes pip
# keep the runtime's own (a 2 GB wheel otherwise); a torch older than gpukit needs is named, with the command that
# updates it, before pip runs. The lessons extra brings what lessons import beyond the core (not JupyterLab: the
# runtime has its own Jupyter).
INSTALL_CELL = """\
# Colab, Kaggle: install gpukit, keeping the runtime's torch. In a clone or after `pip install`: nothing to do.
import importlib.metadata
import importlib.util
import subprocess
import sys

if importlib.util.find_spec("gpukit") is None:
    have = {name: importlib.metadata.version(name) for name in ("torch", "torchvision") if importlib.util.find_spec(name)}
    if "torch" in have and tuple(int(part) for part in have["torch"].split(".")[:2]) < {torch_minimum}:
        raise SystemExit(f"gpukit needs torch >= {torch_text}; this runtime has torch {have['torch']}. Run "
                         '!pip install -q "torch>={torch_text}" "torchvision>={torchvision_text}" in a cell, '
                         "restart the runtime (Runtime > Restart session), then run this cell again.")
    keep = [f"{name}=={version}" for name, version in have.items()]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "gpukit[lessons] @ git+{repository}", *keep], check=True)
    print("installed gpukit from {repository}, keeping", ", ".join(keep) or "no torch: pip chose one")
else:
    print("gpukit is installed: nothing to do")"""


def minimum(name: str) -> str:
    """The oldest version of `name` gpukit accepts, from pyproject.toml's dependencies ("torch>=2.11" → "2.11")."""
    for requirement in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]:
        match = re.fullmatch(rf"{name}>=([\d.]+)", requirement.replace(" ", ""))
        if match:
            return match[1]
    raise ValueError(f"pyproject.toml's dependencies name no {name}>=VERSION")


def install_cell(repo: str) -> str:
    torch_text = minimum("torch")
    return (
        INSTALL_CELL.replace("{repository}", repo)
        .replace("{torch_minimum}", repr(tuple(int(part) for part in torch_text.split(".")[:2])))
        .replace("{torch_text}", torch_text)
        .replace("{torchvision_text}", minimum("torchvision"))
    )


def repository() -> str:
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["urls"]
    return urls["Repository"].rstrip("/")


def badges(lesson: str, repo: str) -> str:
    """Markdown badges opening notebooks/<lesson> of `repo` (a GitHub URL) in Colab and in Kaggle."""
    path = repo.removeprefix("https://github.com/") + f"/blob/main/notebooks/{lesson}"
    colab = f"https://colab.research.google.com/github/{path}"
    kaggle = f"https://kaggle.com/kernels/welcome?src=https://github.com/{path}"
    return (
        f"[![Open in Colab](https://colab.research.google.com/assets/colab-badge.svg)]({colab}) "
        f"[![Open in Kaggle](https://kaggle.com/static/images/open-in-kaggle.svg)]({kaggle})"
    )


def updated_lesson(path: Path, repo: str) -> nbformat.NotebookNode:
    """The lesson with its badge line under the title and the install cell first among its code cells."""
    notebook = nbformat.read(path, as_version=4)
    title = notebook.cells[0]
    # The marker ends the badge line: at its start it would make the whole line raw HTML, the badges plain text.
    lines = [line for line in title.source.split("\n") if BADGES not in line]
    title.source = "\n".join([lines[0], "", f"{badges(path.name, repo)} {BADGES}", *lines[1:]]).replace(
        "\n\n\n", "\n\n"
    )
    cells = [cell for cell in notebook.cells if cell.get("id") != INSTALL_CELL_ID]
    install = nbformat.v4.new_code_cell(install_cell(repo))
    install.id = INSTALL_CELL_ID
    notebook.cells = [cells[0], install, *cells[1:]]
    return notebook


def updated_readme(text: str, repo: str) -> str:
    """The README with each lesson row's badges in its second column."""

    def row(match: re.Match) -> str:
        return f"| `{match[1]}` | {badges(match[1] + '.ipynb', repo)} |"

    return re.sub(r"^\| `(\d\d[a-z]?_\w+)` \|(?: \[!\[Open in Colab\][^|]*\|)?", row, text, flags=re.MULTILINE)


def main(check: bool) -> int:
    repo = repository()
    stale = []
    for path in sorted((ROOT / "notebooks").glob("[0-9][0-9]*_*.ipynb")):
        new = nbformat.writes(updated_lesson(path, repo)) + "\n"
        if new != path.read_text():
            stale.append(path.name)
            if not check:
                path.write_text(new)
    readme = ROOT / "README.md"
    new = updated_readme(readme.read_text(), repo)
    if new != readme.read_text():
        stale.append("README.md")
        if not check:
            readme.write_text(new)
    if stale:
        print(
            ("out of date: " if check else "updated: ")
            + ", ".join(stale)
            + (" (run python tools/open_in.py)" if check else "")
        )
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main(check="--check" in sys.argv[1:]))
