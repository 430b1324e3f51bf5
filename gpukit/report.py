"""Tables that read well in a notebook (HTML) and in a terminal (aligned text)."""

from __future__ import annotations

import html
import json
import math
from collections.abc import Sequence
from pathlib import Path


def format_value(value) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        magnitude = abs(value)
        if value != 0 and (magnitude >= 1e7 or magnitude < 1e-3):
            return f"{value:.3g}"
        if magnitude >= 100:
            return f"{value:,.0f}"
        return f"{value:.1f}" if magnitude >= 10 else (f"{value:.2f}" if magnitude >= 1 else f"{value:.3f}")
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def format_bytes(count: float | None) -> str:
    if count is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count} B"


class Table:
    """Rows of dicts shown as a table: HTML in Jupyter, aligned text in print()."""

    def __init__(
        self,
        rows: Sequence[dict],
        columns: Sequence[str] | None = None,
        title: str | None = None,
        notes: Sequence[str] = (),
    ):
        self.rows = [dict(row) for row in rows]
        self.columns = (
            list(columns) if columns is not None else list(dict.fromkeys(k for row in self.rows for k in row))
        )
        self.title = title
        self.notes = list(notes)  # lines shown under the table

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]

    def column(self, name: str) -> list:
        return [row.get(name) for row in self.rows]

    def __str__(self) -> str:
        cells = [self.columns] + [[format_value(row.get(c)) for c in self.columns] for row in self.rows]
        widths = [max(len(line[i]) for line in cells) for i in range(len(self.columns))]
        lines = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths)).rstrip() for line in cells]
        lines.insert(1, "  ".join("-" * width for width in widths))
        return "\n".join(([self.title] if self.title else []) + lines + self.notes)

    __repr__ = __str__

    def _repr_html_(self) -> str:
        head = "".join(f"<th>{html.escape(c)}</th>" for c in self.columns)
        body = "".join(
            "<tr>" + "".join(f"<td>{html.escape(format_value(row.get(c)))}</td>" for c in self.columns) + "</tr>"
            for row in self.rows
        )
        caption = f"<caption>{html.escape(self.title)}</caption>" if self.title else ""
        notes = "".join(f"<p>{html.escape(note)}</p>" for note in self.notes)
        return f"<table>{caption}<thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>{notes}"


def save_tables(path: str | Path, tables: Sequence[Table], **figures) -> None:
    """Write `tables` (title, columns, rows) and other `figures` (plain values) to `path` as one JSON object:
    {"tables": [{"title", "columns", "rows"}, …], **figures}. The benchmarks' `--json PATH` writes this, and
    `python -m gpukit gpu-check` reads it; a benchmark that could not run here writes no tables and
    `skipped="why"`. NaN and infinity are written as Python's json module does (NaN, Infinity)."""
    content = {"tables": [{"title": t.title, "columns": t.columns, "rows": t.rows} for t in tables], **figures}
    Path(path).write_text(json.dumps(content, indent=1, default=str) + "\n")
