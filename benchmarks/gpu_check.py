"""The GPU check: stock Keras against mpt_keras on Keras' JAX backend, one process per cell.

    python -m benchmarks.gpu_check [--small] [--output=benchmarks/results] [--steps=20]

The reference Transformer (`mpt_keras.models.build_transformer_lm`: width 768, 12 heads, 6
blocks, 512 tokens, batch 16, a 32,768-token vocabulary; 92M parameters) trained in float32
(XLA's matmul precision "highest"), TF32 ("tensorfloat32"), `mixed_bfloat16`, `mixed_float16`
and float8 (the bundled float8 manifest's matmuls; bfloat16 elsewhere), each by stock Keras and
by mpt_keras in its own process, so that peak device memory is that cell's. Per cell: the
median step, examples/s, peak device memory, the final loss, and for our float8 cell the census
of the compiled step (which GEMMs run in float8: ours are dots of float8 operands,
`precision/float8_gemms.py`; stock's are Keras' own); per precision, ours/stock. Stock
Keras never imports mpt_keras: its float16 step gets Keras' own LossScaleOptimizer, its float8
the same layers quantized by `layer.quantize("float8")`.

Written to `<output>/gpu_<date>_<device>.json`, which `python -m benchmarks.docs_tables` makes
docs/benchmarks.md's table of. `--small` is the CPU dry run the suite runs (width 32, 1 block,
a few steps, cells in this process unless `--per_cell_processes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import os
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

os.environ["KERAS_BACKEND"] = "jax"  # Before Keras loads: the check is of Keras' JAX backend.

from absl import app, flags  # noqa: E402

from benchmarks.float8_models import (  # noqa: E402
    TRANSFORMER_REFERENCE,
    TRANSFORMER_SMALL,
    TransformerShape,
    apply_float8,
    build_transformer,
)

BENCHMARK = "gpu_check"  # benchmarks.gpu_table's.
PRECISIONS = ("float32", "tf32", "mixed_bfloat16", "mixed_float16", "float8")
STACKS = ("stock", "ours")
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def measure_cell(precision: str, stack: str, shape: TransformerShape, steps: int) -> dict[str, Any]:
    """Trains one cell's model for 2 warm-up steps (compilation) and `steps` timed ones."""
    import jax
    import keras
    import numpy as np

    from benchmarks import result_files
    from benchmarks.timed_steps import peak_device_bytes, timed_train_steps

    if stack == "ours":  # Our loss scaling for float16, our step logs.
        from mpt_keras.scaling import compile_hook

        compile_hook.install()
    elif "mpt_keras.scaling.compile_hook" in sys.modules:
        raise RuntimeError("a stock cell after mpt_keras hooked Keras' compile")
    keras.utils.set_random_seed(0)
    policy = {"float32": "float32", "tf32": "float32", "float8": "mixed_bfloat16"}
    keras.mixed_precision.set_global_policy(policy.get(precision, precision))
    model = build_transformer(shape)
    if precision == "float8":
        apply_float8(model, stack)
    model.compile(
        optimizer=keras.optimizers.AdamW(1e-4),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=True,
    )
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, shape.vocabulary, size=(shape.batch, shape.tokens + 1), dtype="int32")
    x, y = tokens[:, :-1], tokens[:, 1:]
    # float32: exact float32 matmuls ("highest"); TF32: XLA's "tensorfloat32" (its GPU default).
    matmul = {"float32": "highest", "tf32": "tensorfloat32"}.get(precision)
    with jax.default_matmul_precision(matmul) if matmul else contextlib.nullcontext():
        timed = timed_train_steps(model, x, y, steps)
    census = None
    if precision == "float8" and stack == "ours":  # After timing: it compiles the step again.
        from mpt_keras.precision.float8_census import take_census

        census = take_census(model, (x, y)).to_dict()
    return {
        "precision": precision,
        "stack": stack,
        "optimizer": type(model.optimizer).__module__ + "." + type(model.optimizer).__name__,
        **timed,
        "examples_per_second": shape.batch * 1000 / timed["median_step_ms"],
        "peak_device_bytes": peak_device_bytes(),
        "float8_census": census,
        "device_kind": jax.devices()[0].device_kind,
        "machine": result_files.jax_machine(),  # run_check keeps the first cell's.
    }


def run_check(
    shape: TransformerShape,
    steps: int,
    precisions: Sequence[str],
    per_cell_processes: bool,
    stacks: Sequence[str] = STACKS,
    measured: Callable[[dict[str, Any]], None] = lambda result: None,
) -> dict[str, Any]:
    """Every cell (in its own process when `per_cell_processes`), with ours/stock per
    precision; `measured` gets the result so far after each cell."""
    rows: list[dict[str, Any]] = []
    result = {"benchmark": BENCHMARK, "shape": dataclasses.asdict(shape), "steps": steps,
              "rows": rows}  # fmt: skip
    for stack in [stack for stack in STACKS if stack in stacks]:  # Stock first: in one
        for precision in precisions:  # process, ours hooks Keras for good.
            try:
                if per_cell_processes:
                    rows.append(_cell_in_a_process(precision, stack, shape, steps))
                else:
                    rows.append(measure_cell(precision, stack, shape, steps))
            except Exception as error:  # One failed cell loses no other (a GPU run is one try).
                message = str(error).strip().splitlines() or [type(error).__name__]
                rows.append({"precision": precision, "stack": stack, "error": message[-1][:300]})
            result.setdefault("machine", rows[-1].pop("machine", None))
            result.update(_ratios(rows, precisions))
            measured(result)
    return result


def _ratios(rows: Sequence[dict[str, Any]], precisions: Sequence[str]) -> dict[str, Any]:
    """Ours/stock per precision, and stock `mixed_bfloat16`'s speedups, of the cells so far."""
    times = {(r["precision"], r["stack"]): r.get("median_step_ms") for r in rows}
    ratios = {
        p: times[p, "ours"] / times[p, "stock"]
        for p in precisions
        if times.get((p, "ours")) and times.get((p, "stock"))
    }
    speedups = {
        f"mixed_bfloat16_over_{base}": times[base, "stock"] / times["mixed_bfloat16", "stock"]
        for base in ("float32", "tf32")
        if times.get((base, "stock")) and times.get(("mixed_bfloat16", "stock"))
    }
    return {"ours_over_stock": ratios, "speedups": speedups}


def _cell_in_a_process(
    precision: str, stack: str, shape: TransformerShape, steps: int
) -> dict[str, Any]:
    command = [
        sys.executable, "-m", "benchmarks.gpu_check", f"--cell={precision},{stack}",
        f"--steps={steps}", f"--shape={json.dumps(dataclasses.asdict(shape))}",
    ]  # fmt: skip
    done = subprocess.run(command, cwd=_REPO, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        errors = [line for line in done.stderr.splitlines() if "Error" in line]
        raise RuntimeError((errors or done.stderr.splitlines() or ["no output"])[-1])
    return json.loads(done.stdout.strip().splitlines()[-1])


def result_path(output: str, device_kind: str, today: datetime.date) -> str:
    """`<output>/gpu_<date>_<device>.json`."""
    from benchmarks import result_files

    return result_files.device_result_path(output, "gpu", device_kind, today)


FLAGS = flags.FLAGS
flags.DEFINE_bool("small", False, "The CPU dry run: a width-32 model, a few steps.")
flags.DEFINE_integer("steps", None, "Timed steps per cell (default 20; --small: 3).", lower_bound=1)
flags.DEFINE_list("precisions", list(PRECISIONS), f"Any of {', '.join(PRECISIONS)}.")
flags.DEFINE_list("stacks", list(STACKS), f"Any of {', '.join(STACKS)}.")
flags.DEFINE_string("output", "benchmarks/results", "The folder the result file is written to.")
flags.DEFINE_bool(
    "per_cell_processes", None, "One process per cell (default: yes, except with --small)."
)
flags.DEFINE_string("cell", None, "Internal: measure one cell, `precision,stack`; print JSON.")
flags.DEFINE_string(
    "shape",
    None,
    "The model's shape as JSON (TransformerShape's fields), instead of --small's or the "
    "reference's.",
)


def main(argv: Sequence[str]) -> None:
    from mpt_keras.checks import refusal

    if FLAGS.cell:
        precision, stack = FLAGS.cell.split(",")
        shape = TransformerShape(**json.loads(FLAGS.shape))
        print(json.dumps(measure_cell(precision, stack, shape, FLAGS.steps)))
        return
    for name, given, allowed in (
        ("--precisions", FLAGS.precisions, PRECISIONS),
        ("--stacks", FLAGS.stacks, STACKS),
    ):
        unknown = [value for value in given if value not in allowed]
        if unknown:
            raise app.UsageError(str(refusal(name, ",".join(unknown), ", ".join(allowed))))
    shape = TRANSFORMER_SMALL if FLAGS.small else TRANSFORMER_REFERENCE
    if FLAGS.shape:
        shape = TransformerShape(**json.loads(FLAGS.shape))
    steps = FLAGS.steps or (3 if FLAGS.small else 20)
    per_cell = not FLAGS.small if FLAGS.per_cell_processes is None else FLAGS.per_cell_processes
    from benchmarks import result_files

    command = result_files.record(["python", "-m", "benchmarks.gpu_check", *sys.argv[1:]])
    os.makedirs(FLAGS.output, exist_ok=True)

    def path_of(result: dict[str, Any]) -> str | None:
        """The file, named after the first cell's device (with a process per cell this one
        never starts JAX: it would hold the GPU's memory); None before a cell ran."""
        kinds = [row["device_kind"] for row in result["rows"] if "device_kind" in row]
        return result_path(FLAGS.output, kinds[0], datetime.date.today()) if kinds else None

    def write(result: dict[str, Any]) -> None:  # After each cell: a stopped run keeps them.
        if path := path_of(result):
            with open(path, "w", encoding="utf-8") as file:
                json.dump({**result, "run": command}, file, indent=2)

    result = run_check(shape, steps, FLAGS.precisions, per_cell, FLAGS.stacks, write)
    path = path_of(result)
    if path is None:
        sys.exit(f"gpu_check: no cell ran: {'; '.join(row['error'] for row in result['rows'])}")
    for row in result["rows"]:
        figure = row.get("error") or f"{row['median_step_ms']:.2f} ms a step"
        print(f"{row['precision']:>15} {row['stack']:>5}: {figure}")
    for precision, ratio in result["ours_over_stock"].items():
        print(f"{precision:>15}: ours/stock {ratio:.3f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    app.run(main)
