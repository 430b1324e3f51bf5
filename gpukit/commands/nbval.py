"""Your own notebooks under nbval: the sanitize file gpukit ships for strict output comparison.

    pytest --nbval --nbval-sanitize-with="$(python -m gpukit nbval-sanitize-path)" my_notebooks/

masks what changes from run to run in gpukit's outputs (times, throughputs, memory sizes,
percentages, progress bars, GPU names, temporary paths), so that strict nbval compares the rest.
With `--nbval-lax` (only cells that raise fail: the assert cells) no sanitize file is needed.
See docs/nbval.md.
"""

from __future__ import annotations

from pathlib import Path

SANITIZE_FILE = Path(__file__).with_name("nbval_sanitize.cfg")


def sanitize_path() -> Path:
    """Path of gpukit's nbval sanitize file (installed with the package), for `--nbval-sanitize-with`."""
    if not SANITIZE_FILE.is_file():
        raise FileNotFoundError(
            f"gpukit's sanitize file is missing at {SANITIZE_FILE}: reinstall gpukit (pip install -e .) so that "
            "its package data is installed."
        )
    return SANITIZE_FILE
