"""Float8 where it should pay most: MLP blocks, Keras' float8 and ours against bfloat16 (JAX).

    KERAS_BACKEND=jax python -m benchmarks.float8_mlp [--small] [--width=4096] [--output=...]

Issue 34's goal: on an H100, float8 at least 1.3x bfloat16's step time on two MLP blocks of
width 4096 (8192 tokens of 1024). Each variant trains a fresh model of the same shape in this
process, 2 warm-up steps (the compile), then `--steps` timed ones (median). Variants:
`bfloat16` (`mixed_bfloat16`); `float8 keras` (`layer.quantize("float8")`, Keras' own call);
`float8 delayed` and `float8 current` (`to_float8` with each scaling: our GEMMs,
`precision/float8_gemms.py`). Each float8 variant records the census of its compiled step
(which GEMMs run in float8), and every variant its speed over `bfloat16`. Written to
`<output>/float8_mlp_<date>_<device>.json`, again after each variant (a run stopped midway
keeps what it measured). `--width` times the same blocks at another width (the issue's 768 and
2048). `--small` is the CPU dry run the suite runs
(tests/jax_backend/test_float8_mlp_benchmark.py): width 32, one block, a few steps, all emulated.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import app, flags

from benchmarks.float8_models import (
    MLP_REFERENCE,
    MLP_SMALL,
    MlpShape,
    apply_mlp_float8,
    build_mlp,
)

VARIANTS = ("bfloat16", "float8 keras", "float8 delayed", "float8 current")


def measure_variant(variant: str, shape: MlpShape, steps: int) -> dict[str, Any]:
    """One variant's median step, peak device memory, final loss and (float8) census."""
    import keras
    import numpy as np

    from benchmarks.timed_steps import peak_device_bytes, timed_train_steps
    from mpt_keras.precision.float8_census import take_census
    from mpt_keras.precision.policies import global_policy

    keras.utils.set_random_seed(0)
    with global_policy("mixed_bfloat16"):
        model = build_mlp(shape)
    apply_mlp_float8(model, variant)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss="mse", jit_compile=True)
    rng = np.random.default_rng(0)
    size = (shape.sequences, shape.tokens, shape.width)
    x = rng.standard_normal(size).astype("float32")
    y = rng.standard_normal(size).astype("float32")
    timed = timed_train_steps(model, x, y, steps)
    census = take_census(model, (x, y)) if variant != "bfloat16" else None
    return {
        "variant": variant,
        **timed,
        "tokens_per_second": shape.sequences * shape.tokens * 1000 / timed["median_step_ms"],
        "peak_device_bytes": peak_device_bytes(),
        "float8_census": census.to_dict() if census else None,
        "census_summary": census.summary() if census else None,
    }


def run(
    shape: MlpShape,
    steps: int,
    variants: Sequence[str] = VARIANTS,
    measured: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every variant (one failing loses no other: a GPU run is one try) and its speed over
    bfloat16 (bfloat16's step time over its own); `measured` gets the result so far after
    each variant."""
    rows: list[dict[str, Any]] = []
    result = {"benchmark": "float8_mlp", "shape": dataclasses.asdict(shape), "steps": steps,
              "rows": rows}  # fmt: skip
    for variant in variants:
        try:
            rows.append(measure_variant(variant, shape, steps))
        except Exception as error:
            message = str(error).strip().splitlines() or [type(error).__name__]
            rows.append({"variant": variant, "error": message[-1][:300]})
        base = next((r.get("median_step_ms") for r in rows if r["variant"] == "bfloat16"), None)
        for row in rows:
            ms = row.get("median_step_ms")
            row["speed_over_bfloat16"] = base / ms if base and ms else None
        measured(result)
    return result


FLAGS = flags.FLAGS
flags.DEFINE_bool("small", False, "The CPU dry run: width 32, one block, a few steps.")
flags.DEFINE_integer("steps", None, "Timed steps per variant (default 20; --small: 2).", 1)
flags.DEFINE_integer(
    "width", None, f"The blocks' width (default {MLP_REFERENCE.width}; not with --small).", 8
)
flags.DEFINE_string("output", "benchmarks/results", "The folder the result file is written to.")


def main(argv: Sequence[str]) -> None:
    import jax

    from benchmarks import result_files

    if FLAGS.small and FLAGS.width:
        raise app.UsageError("--width: not with --small (its width is 32). Allowed: one of them")
    shape = MLP_SMALL if FLAGS.small else MLP_REFERENCE
    if FLAGS.width:
        shape = dataclasses.replace(shape, width=FLAGS.width)
    header = {
        "machine": result_files.jax_machine(),
        "run": result_files.record(["python", "-m", "benchmarks.float8_mlp", *sys.argv[1:]]),
    }
    device = jax.devices()[0].device_kind
    path = result_files.device_result_path(
        FLAGS.output, "float8_mlp", device, datetime.date.today()
    )
    os.makedirs(FLAGS.output, exist_ok=True)

    def write(result: dict[str, Any]) -> None:
        with open(path, "w", encoding="utf-8") as file:
            json.dump({**result, **header}, file, indent=2)

    result = run(shape, FLAGS.steps or (2 if FLAGS.small else 20), measured=write)
    for row in result["rows"]:
        figure = row.get("error") or (
            f"{row['median_step_ms']:.2f} ms a step, {row['speed_over_bfloat16']:.2f}x bfloat16"
            + (f"; {row['census_summary']}" if row["census_summary"] else "")
        )
        print(f"{row['variant']:>15}: {figure}")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
