"""Which float8 GEMMs would run in float8 on a GPU, found on any machine: the census, compiled.

    python -m benchmarks.float8_census [--target=h100] [--small] [--output=benchmarks/results]

Nothing runs and no GPU is needed: XLA's own GPU compiler compiles each model's train step for
`--target` (JAX's CUDA plugin, `mpt_keras/backend/jax/gpu_targets.py`; no autotuning) and the
census reads the program. Models: the float8 MLP blocks of `benchmarks/float8_mlp.py` (width
4096) with Keras' float8, ours with delayed and with current scaling; the reference
Transformer of `benchmarks/gpu_check.py` (width 768, 6 blocks) with Keras' float8 and with
the bundled float8 manifest (ours). Each with XLA's Triton GEMMs on (its default) and off
(`--xla_gpu_enable_triton_gemm=false`: cuBLAS takes every GEMM), the second in a child
process (XLA reads its flags once). Written to `<output>/float8_census_<date>_<target>.json`,
whose table `python -m benchmarks.docs_tables` makes. `--small` shrinks both models (the
suite's dry run, tests/jax_backend/test_float8_census_benchmark.py).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"  # Before Keras loads: only JAX compiles for a GPU target.

from absl import app, flags  # noqa: E402

from mpt_keras.backend.names import GPU_TARGETS  # noqa: E402

BENCHMARK = "float8_census"  # benchmarks.census_table's.
# Each model's float8 variants: the stack whose float8 layers it uses, and their scaling.
CELLS = (
    ("mlp", "float8 keras"),
    ("mlp", "float8 delayed"),
    ("mlp", "float8 current"),
    ("transformer", "float8 keras"),
    ("transformer", "float8 manifest"),
)
TRITON_OFF = "--xla_gpu_enable_triton_gemm=false"


def census_of_cell(model_name: str, variant: str, small: bool, target: str) -> dict[str, Any]:
    """One cell's census, compiled for `target`: the model built, its float8 layers set, its
    train step compiled as `fit` compiles it."""
    import keras
    import numpy as np

    from benchmarks import float8_models as models
    from mpt_keras.precision.float8_census import take_census
    from mpt_keras.precision.policies import global_policy

    keras.utils.set_random_seed(0)
    rng = np.random.default_rng(0)
    with global_policy("mixed_bfloat16"):
        if model_name == "mlp":
            shape = models.MLP_SMALL if small else models.MLP_REFERENCE
            model = models.build_mlp(shape)
            size = (shape.sequences, shape.tokens, shape.width)
            batch = tuple(rng.standard_normal(size).astype("float32") for _ in range(2))
            loss = "mse"
        else:
            shape = models.TRANSFORMER_SMALL if small else models.TRANSFORMER_REFERENCE
            model = models.build_transformer(shape)
            tokens = rng.integers(0, shape.vocabulary, (shape.batch, shape.tokens + 1))
            batch = (tokens[:, :-1].astype("int32"), tokens[:, 1:].astype("int32"))
            loss = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    model(batch[0][:1])
    if model_name == "transformer":
        models.apply_float8(model, "stock" if variant == "float8 keras" else "ours")
    else:
        models.apply_mlp_float8(model, variant)
    model.compile(optimizer=keras.optimizers.AdamW(1e-4), loss=loss, jit_compile=True)
    census = take_census(model, batch, target=target)
    return {
        "model": model_name,
        "shape": dataclasses.asdict(shape),
        "variant": variant,
        "census": census.to_dict(),
    }


def cells_here(small: bool, target: str, triton_gemms: bool) -> list[dict[str, Any]]:
    """Every cell in this process (whose XLA flags say whether Triton GEMMs are on); a failed
    cell records its error in one line and loses no other."""
    rows = []
    for model_name, variant in CELLS:
        try:
            row = census_of_cell(model_name, variant, small, target)
        except Exception as error:
            message = str(error).strip().splitlines() or [type(error).__name__]
            row = {"model": model_name, "variant": variant, "error": message[-1][:300]}
        rows.append({**row, "triton_gemms": triton_gemms})
    return rows


def cells_in_a_child(small: bool, target: str) -> list[dict[str, Any]]:
    """Every cell with XLA's Triton GEMMs off, in a child process."""
    with tempfile.TemporaryDirectory() as folder:
        part = os.path.join(folder, "cells.json")
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {TRITON_OFF}"}
        command = [sys.executable, "-m", "benchmarks.float8_census", f"--target={target}",
                   f"--part={part}", *(["--small"] if small else [])]  # fmt: skip
        subprocess.run(command, env=env, check=True)
        with open(part, encoding="utf-8") as file:
            return json.load(file)


FLAGS = flags.FLAGS


def define_flags() -> None:
    """The script's flags, defined when it runs (not on import: the float8 MLP benchmark,
    imported in the same process by the suite, defines some of the same names)."""
    flags.DEFINE_enum("target", "h100", list(GPU_TARGETS), "The GPU the steps are compiled for.")
    flags.DEFINE_bool("small", False, "Both models shrunk: the suite's dry run.")
    flags.DEFINE_string("output", "benchmarks/results", "The folder the result file goes to.")
    flags.DEFINE_string("part", None, "Internal: write this process's cells to this file only.")


def main(argv: Sequence[str]) -> None:
    from benchmarks import result_files

    triton_gemms = TRITON_OFF not in os.environ.get("XLA_FLAGS", "")
    rows = cells_here(FLAGS.small, FLAGS.target, triton_gemms)
    if FLAGS.part:
        with open(FLAGS.part, "w", encoding="utf-8") as file:
            json.dump(rows, file)
        return
    if triton_gemms:
        rows += cells_in_a_child(FLAGS.small, FLAGS.target)
    result = {"benchmark": BENCHMARK, "target": FLAGS.target, "rows": rows}
    result["machine"] = result_files.jax_machine()
    result["run"] = result_files.record(["python", "-m", "benchmarks.float8_census", *sys.argv[1:]])
    path = result_files.device_result_path(
        FLAGS.output, BENCHMARK, FLAGS.target, datetime.date.today()
    )
    os.makedirs(FLAGS.output, exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(result, file, indent=2)
    for row in rows:
        triton = "Triton GEMMs on " if row["triton_gemms"] else "Triton GEMMs off"
        figure = row.get("error") or row["census"]["summary"].split(" (")[0]
        print(f"{row['model']:>11} {row['variant']:>15}, {triton}: {figure}")
    print(f"wrote {path}")


if __name__ == "__main__":
    define_flags()
    app.run(main)
