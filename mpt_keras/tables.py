"""Text tables: rows of cells in aligned columns, as the launchers print them."""

from __future__ import annotations

from collections.abc import Sequence


def aligned(rows: Sequence[Sequence[str]], indent: str = "") -> list[str]:
    """Each row as one line, every column as wide as its widest cell; no trailing spaces."""
    widths = (
        [max(len(row[column]) for row in rows) for column in range(len(rows[0]))] if rows else []
    )
    return [
        (indent + "  ".join(cell.ljust(width) for cell, width in zip(row, widths))).rstrip()
        for row in rows
    ]
