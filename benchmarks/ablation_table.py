"""The stack ablation's table: the results file of its cells, and its rows in docs/benchmarks.md.

A results file is `{"benchmark": "stack_ablation", "cells": [...]}`, a cell
per (model, precision, XLA setting), each one run's result with its `run`
record; every cell must have measured the same variants (the table's columns).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks import result_files
from mpt_keras.errors import UserInputError

BENCHMARK = "stack_ablation"
# The goal: our stack's step time at most 1.03x stock Keras'.
GOAL_OVER_STOCK = 1.03


def cells(results: Any, source: str) -> list[dict[str, Any]]:
    """The cells of a results file's JSON, in the order first measured.

    Raises:
        UserInputError: If `results` is not such a file, or has a cell twice.
    """
    if not isinstance(results, Mapping):
        received = f"a JSON {type(results).__name__}"
    elif results.get("benchmark") != BENCHMARK:
        received = f"benchmark {results.get('benchmark')!r}"
    elif not isinstance(results.get("cells"), list):
        received = "a result without 'cells' (as --output writes one run's)"
    else:
        names = [_cell_name(cell) for cell in results["cells"]]
        twice = [name for name in dict.fromkeys(names) if names.count(name) > 1]
        if twice:
            raise UserInputError(
                f"{source}: cell {twice[0]} measured twice. Allowed: each cell once"
            )
        return list(results["cells"])
    raise UserInputError(
        f"{source}: received {received}. Allowed: a stack ablation results file "
        '({"benchmark": "stack_ablation", "cells": [...]}, as --add_to writes it)'
    )


def load_cells(path: str) -> list[dict[str, Any]]:
    """The cells of the results file at `path`; none if there is no such file.

    Raises:
        UserInputError: As `cells`, or if it is not JSON.
    """
    results = result_files.read(path)
    return [] if results is None else cells(results, path)


def add_cell(path: str, cell: Mapping[str, Any]) -> None:
    """Writes the results file `path` (created if absent) with `cell` in place of its
    earlier measurement; a new cell goes last.

    Raises:
        UserInputError: As `load_cells`.
    """
    measured = {_cell_name(other): other for other in load_cells(path)}
    measured[_cell_name(cell)] = cell
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"benchmark": BENCHMARK, "cells": list(measured.values())}, file, indent=2)


def markdown_table(measured: Sequence[Mapping[str, Any]], source: str) -> list[str]:
    """The cells as the table of docs/benchmarks.md, its legend, and ours over stock per
    model against `GOAL_OVER_STOCK`.

    Raises:
        UserInputError: If there are no cells, or they measured different
            variants (a piece added since some were measured).
    """
    if not measured:
        raise UserInputError(f"{source}: received no cells. Allowed: one or more")
    names = {_cell_name(cell): list(cell["median_step_seconds"]) for cell in measured}
    first, *others = names
    for name in others:
        if names[name] != names[first]:
            raise UserInputError(
                f"{source}: cell {name} measured the variants {names[name]}, cell {first} "
                f"{names[first]}. Allowed: the same in every cell (measure the older cells again)"
            )
    stock, *pieces = names[first]
    ours = pieces[-1]
    table = [
        f"| model | precision | XLA | {stock} ms | ours ms | ours / {stock} | "
        + " | ".join(f"`{name}`" for name in pieces)
        + " |",
        "|---|---|---|" + "---:|" * (3 + len(pieces)),
    ]
    over_stock: dict[str, list[float]] = {}
    for cell in measured:
        ratios = [cell["vs_stock"][ours], *(cell["vs_previous"][name] for name in pieces)]
        over_stock.setdefault(cell["model"], []).append(ratios[0]["paired_ratio_median"])
        medians = cell["median_step_seconds"]
        table.append(
            f"| {cell['model']} | {cell['precision']} | {'on' if cell['xla'] else 'off'} | "
            f"{medians[stock] * 1e3:.2f} | {medians[ours] * 1e3:.2f} | "
            + " | ".join(f"{ratio['paired_ratio_median']:.3f}" for ratio in ratios)
            + " |"
        )
    ranges = ", ".join(
        f"{model} {min(ratios):.3f}" + (f"-{max(ratios):.3f}" if len(ratios) > 1 else "")
        for model, ratios in over_stock.items()
    )
    within = sum(ratio <= GOAL_OVER_STOCK for ratios in over_stock.values() for ratio in ratios)
    return [
        *table,
        "",
        f"ms: median step time. ours / stock: `{ours}` (every piece: `mpt-bench`'s `ours`) over "
        f"{stock}; `+<piece>`: the variant that adds it over the one before ({stock} for "
        f"`{pieces[0]}`). Step-time ratios, medians of the per-round ratios; below 1: faster.",
        "",
        f"ours / stock by model: {ranges}; at most {GOAL_OVER_STOCK} (the goal) in {within} of "
        f"{len(measured)} cells.",
    ]


def _cell_name(cell: Mapping[str, Any]) -> str:
    return f"{cell['model']}/{cell['precision']}/xla_{'on' if cell['xla'] else 'off'}"
