"""The table docs/benchmarks.md shows of a `benchmarks.float8_census` result (no Keras needed)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from typing import Any

from mpt_keras.errors import UserInputError

BENCHMARK = "float8_census"
_VARIANTS = {
    "float8 keras": "Keras' own (`quantize`)",
    "float8 delayed": "ours, delayed scaling",
    "float8 current": "ours, current scaling",
    "float8 manifest": "ours (the float8 manifest)",
}


def markdown_table(result: Mapping[str, Any], source: str) -> list[str]:
    """Per model, float8 variant and Triton setting: how many GEMMs run in float8, and what
    XLA made of them (kernel and operand type, counted); a failed cell shows its error.

    Raises:
        UserInputError: If `result` has no rows.
    """
    rows = result.get("rows")
    if not rows:
        raise UserInputError(f"{source}: received no rows. Allowed: a float8_census result")
    lines = [
        f"Each train step compiled for an {result['target'].upper()} on this machine, no GPU "
        "present (XLA's GPU compiler, before autotuning), never run.",
        "",
        "| model | float8 layers | XLA's Triton GEMMs | GEMMs in float8 | what XLA made of them |",
        "|---|---|---|---:|---|",
    ]
    for row in rows:
        triton = "on (default)" if row["triton_gemms"] else "off"
        head = f"| {_model(row)} | {_VARIANTS.get(row['variant'], row['variant'])} | {triton} |"
        if "error" in row:
            lines.append(f"{head} | not compiled: {row['error']} |")
            continue
        gemms = row["census"]["gemms"]
        in_float8 = sum(gemm["verdict"] == "float8" for gemm in gemms)
        kinds = Counter((gemm["kernel"], gemm["runs_in"]) for gemm in gemms)
        made = ", ".join(f"{n} `{kernel}` in {runs_in}" for (kernel, runs_in), n in kinds.items())
        lines.append(f"{head} {in_float8} of {len(gemms)} | {made} |")
    return lines


def _model(row: Mapping[str, Any]) -> str:
    shape = row.get("shape")
    if not shape:
        return row["model"]
    if row["model"] == "mlp":
        return (
            f"MLP, {shape['blocks']} blocks of width {shape['width']}, "
            f"{shape['sequences']} x {shape['tokens']} tokens"
        )
    return (
        f"Transformer, width {shape['width']}, {shape['blocks']} blocks, "
        f"{shape['batch']} x {shape['tokens']} tokens"
    )
