"""The table docs/benchmarks.md shows of a `benchmarks.gpu_check` result (no Keras needed)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mpt_keras.errors import UserInputError

BENCHMARK = "gpu_check"


def markdown_table(result: Mapping[str, Any], source: str) -> list[str]:
    """Per precision: stock and ours (median step, examples/s, peak memory, final loss), and
    ours/stock; a failed cell shows its one-line error. Then bfloat16's speedups.

    Raises:
        UserInputError: If `result` has no rows.
    """
    rows = result.get("rows")
    if not rows:
        raise UserInputError(f"{source}: received no rows. Allowed: a gpu_check result")
    shape = result["shape"]
    lines = [
        f"Transformer of width {shape['width']}, {shape['heads']} heads, {shape['blocks']} "
        f"blocks, {shape['tokens']} tokens, batch {shape['batch']}, vocabulary "
        f"{shape['vocabulary']}; median of {result['steps']} steps after 2 warm-up steps.",
        "",
        "| precision | stack | step (ms) | examples/s | peak memory (MiB) | final loss |"
        " ours/stock |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    ratios = result.get("ours_over_stock", {})
    for row in rows:
        ratio = ratios.get(row["precision"]) if row["stack"] == "ours" else None
        ratio_cell = "" if ratio is None else f"{ratio:.3f}"
        if "error" in row:
            cells = [f"not run: {row['error']}", "", "", ""]
        else:
            peak = row.get("peak_device_bytes")
            cells = [
                f"{row['median_step_ms']:.2f}",
                f"{row['examples_per_second']:.1f}",
                "n/a" if peak is None else f"{peak / 2**20:.0f}",
                f"{row['final_loss']:.4f}",
            ]
        lines.append(
            f"| {row['precision']} | {row['stack']} | " + " | ".join(cells) + f" | {ratio_cell} |"
        )
    speedups = result.get("speedups", {})
    if speedups:
        lines += [
            "",
            "Stock `mixed_bfloat16`'s speedup in step time: "
            + ", ".join(
                f"{value:.2f}x over {name.removeprefix('mixed_bfloat16_over_')}"
                for name, value in speedups.items()
            )
            + ".",
        ]
    return lines
