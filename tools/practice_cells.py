"""Insert each lesson's Practice section (gpukit/practice/lessonNN.py) into its notebook, or check that it is there.

    python tools/practice_cells.py                 # every lesson, in place
    python tools/practice_cells.py 03 06b          # some lessons
    python tools/practice_cells.py --check         # exit 1 if a lesson's Practice cells differ from the modules'
    python tools/practice_cells.py --out DIR       # write the changed notebooks into DIR instead

The section goes before the lesson's closing section (the module's BEFORE, a heading found by its text), and
replaces the Practice cells inserted before (found by their metadata), so running it again changes nothing. The
notebook is written as Jupyter writes it, outputs cleared, ids kept.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpukit import practice  # noqa: E402
from gpukit.practice import cells  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("lessons", nargs="*", help="lesson numbers (00, 06b, ...); default: every lesson")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 where a lesson differs")
    parser.add_argument("--out", type=Path, help="write the notebooks here instead of over the lessons")
    options = parser.parse_args(argv)
    chosen = [
        lesson for lesson in practice.lessons() if not options.lessons or lesson.LESSON.split("_")[0] in options.lessons
    ]
    if options.lessons and len(chosen) != len(options.lessons):
        parser.error(
            f"unknown lesson among {options.lessons}; known: "
            f"{', '.join(lesson.LESSON.split('_')[0] for lesson in practice.lessons())}"
        )
    differ = []
    for lesson in chosen:
        path = ROOT / "notebooks" / f"{lesson.LESSON}.ipynb"
        text = path.read_text()
        updated = (
            json.dumps(cells.insert(json.loads(text), lesson), indent=1, sort_keys=True, ensure_ascii=False) + "\n"
        )
        if updated == text:
            continue
        differ.append(path.name)
        if not options.check:
            target = options.out / path.name if options.out else path
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(updated)
    verb = "differ from gpukit/practice" if options.check else "written"
    print(f"{len(differ)} of {len(chosen)} lessons {verb}" + (f": {', '.join(differ)}" if differ else ""))
    return 1 if options.check and differ else 0


if __name__ == "__main__":
    sys.exit(main())
