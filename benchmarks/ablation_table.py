"""The stack ablation's table: the results file of its cells, and its rows in docs/benchmarks.md.

`python -m benchmarks.stack_ablation` measures one cell (model, precision,
XLA setting) a run; `--add_to` adds it to a results file (`add_cell`):

    {"benchmark": "stack_ablation", "cells": [<one run's result>, ...]}

each cell as `stack_ablation.measure` returns it, with its `run` record
(`benchmarks.result_files`). `python -m benchmarks.docs_tables` makes the
table of docs/benchmarks.md from it (`markdown_table`): its columns are the
variants the cells measured, which must be the same in every cell.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from benchmarks import result_files
from mpt_keras.errors import UserInputError

BENCHMARK = "stack_ablation"
# The issue's goal: our stack's step time at most 1.03x stock Keras'.
GOAL_OVER_STOCK = 1.03


def cells(results: Any, source: str) -> list[dict[str, Any]]:
    """The measured cells of a results file's JSON, in the order first measured.

    Raises:
        UserInputError: If `results` is not a results file of this benchmark,
            or measures a cell twice.
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
        UserInputError: As `cells`, or if the file is not JSON.
    """
    results = result_files.read(path)
    return [] if results is None else cells(results, path)


def add_cell(path: str, cell: Mapping[str, Any]) -> None:
    """Writes the results file `path` with `cell` in place of its cell's earlier measurement.

    A cell measured for the first time goes last: the table's rows are in the
    order the cells were first measured. The file and its directory are
    created if absent.

    Raises:
        UserInputError: As `load_cells`.
    """
    measured = {_cell_name(other): other for other in load_cells(path)}
    measured[_cell_name(cell)] = cell
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump({"benchmark": BENCHMARK, "cells": list(measured.values())}, file, indent=2)


def markdown_table(measured: Sequence[Mapping[str, Any]], source: str) -> list[str]:
    """The cells as the table of docs/benchmarks.md, what its columns are, and a summary line.

    A row per cell, in the order given: the median step time of stock and of
    ours (every piece), ours over stock, and each piece's variant over the one
    before it, as medians of the per-round ratios. The summary gives ours over
    stock per model and how many cells meet `GOAL_OVER_STOCK`.

    Args:
        measured: One or more cells.
        source: Where they were read, for errors.

    Raises:
        UserInputError: If there are no cells, or the cells measured
            different variants (a piece added since some were measured).
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
