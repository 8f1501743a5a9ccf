"""Where our stack's step time goes: stock Keras, then each piece of ours added in turn.

    python -m benchmarks.stack_ablation [--model=mlp --precision=float32 --xla=off
                                         --rounds=20 --steps_per_round=10
                                         --add_to=benchmarks/results/stack_ablation.json]

For one reference model, precision and XLA setting (a cell of the table in
docs/benchmarks.md), `stock` and then each piece of ours added in turn
(`benchmarks.stacks`) train from the same weights on the same batches,
interleaved in one process (`harness.FitLoop`). Each piece's cost is its
variant's step time over the one before. `--add_to` puts the cell in a
results file (`benchmarks.ablation_table`); `--output` writes this run alone.
"""

from __future__ import annotations

import statistics
import sys
import tempfile
from collections.abc import Sequence

from absl import app, flags

from benchmarks import (
    ablation_table,
    common_flags,
    harness,
    result_files,
    stacks,
    suite_settings,
    workloads,
)
from mpt_keras.errors import UserInputError
from mpt_keras.precision.names import POLICY_NAMES
from mpt_keras.precision.policies import global_policy

VARIANTS = ("stock", *(f"+{piece}" for piece in stacks.PIECES))


def _define_flags() -> None:
    """Defines this program's own flags; only when it runs, as their names are common."""
    flags.DEFINE_enum("model", "transformer_lm", suite_settings.MODELS, "The reference model.")
    flags.DEFINE_enum("precision", "mixed_float16", POLICY_NAMES, "Global dtype policy.")
    flags.DEFINE_enum("xla", "off", suite_settings.XLA_SETTINGS, "Compile the train step with XLA.")
    flags.DEFINE_integer("image_batch_size", 64, "CNN and MLP images per batch.", lower_bound=1)
    flags.DEFINE_string(
        "add_to",
        None,
        "Results file (JSON) to add this cell to, replacing the cell's earlier measurement; "
        "created if absent. The docs' table is made from benchmarks/results/stack_ablation.json.",
    )


def measure(
    model_name: str,
    precision: str,
    jit_compile: bool,
    rounds: int,
    steps_per_round: int,
    warmup_steps: int,
    batch_size: int,
    sequence_length: int = 64,
    num_layers: int = 2,
    d_model: int = 64,
) -> dict:
    """Measures the variants, interleaved; returns the JSON-ready result.

    `batch_size` is in sequences for the Transformer LM, in images otherwise.
    """
    workload = workloads.reference(model_name, batch_size, sequence_length, num_layers, d_model)
    loops = {}
    with tempfile.TemporaryDirectory() as log_dir, global_policy(precision):
        for count, name in enumerate(VARIANTS):
            model = workload.build()
            callbacks = stacks.compile_stack(
                model,
                precision,
                jit_compile,
                stacks.PIECES[:count],
                log_dir,
                batch_size,
                loss=workload.loss,
            )
            loops[name] = harness.FitLoop(model, iter(workload.batches()), callbacks)
        # After every variant is built, as in mpt-bench.
        for loop in loops.values():
            loop(warmup_steps)
        step_seconds = harness.interleave(loops, rounds, steps_per_round)
        for loop in loops.values():
            loop.end()
    return {
        "benchmark": ablation_table.BENCHMARK,
        "model": model_name,
        "precision": precision,
        "xla": jit_compile,
        "batch_size": batch_size,
        "rounds": rounds,
        "steps_per_round": steps_per_round,
        "median_step_seconds": {
            name: statistics.median(seconds) for name, seconds in step_seconds.items()
        },
        "step_seconds": step_seconds,
        "vs_stock": {
            name: harness.ratio(step_seconds[name], step_seconds["stock"]) for name in VARIANTS[1:]
        },
        "vs_previous": {
            name: harness.ratio(step_seconds[name], step_seconds[previous])
            for previous, name in zip(VARIANTS, VARIANTS[1:])
        },
        "machine": harness.machine(),
    }


def lines(result: dict) -> list[str]:
    """The table: per variant, its median step, and its step time over stock and the one before."""
    medians = result["median_step_seconds"]
    width = max(map(len, VARIANTS))
    table = [
        f"{result['model']}, {result['precision']}, XLA {'on' if result['xla'] else 'off'}, "
        f"batch {result['batch_size']}: step time over stock / over the row above "
        "(median of the per-round ratios)",
        f"{'variant':<{width}} {'median step (ms)':>17} {'/stock':>7} {'/above':>7}",
        f"{'stock':<{width}} {medians['stock'] * 1e3:>17.3f} {'-':>7} {'-':>7}",
    ]
    for name in VARIANTS[1:]:
        over_stock = result["vs_stock"][name]["paired_ratio_median"]
        over_previous = result["vs_previous"][name]["paired_ratio_median"]
        table.append(
            f"{name:<{width}} {medians[name] * 1e3:>17.3f} {over_stock:>7.3f} {over_previous:>7.3f}"
        )
    return table


def main(argv: Sequence[str]) -> None:
    del argv
    options = flags.FLAGS
    run = result_files.record(["python", "-m", "benchmarks.stack_ablation", *sys.argv[1:]])
    if options.add_to:
        # Before measuring: a wrong file or another machine's cells cost no run.
        try:
            earlier = ablation_table.load_cells(options.add_to)
            result_files.one_machine(
                [*earlier, {"machine": harness.machine(), "run": run}], options.add_to
            )
        except UserInputError as error:
            sys.exit(f"stack_ablation: error: {error}")
    is_lm = options.model == "transformer_lm"
    result = measure(
        options.model,
        options.precision,
        options.xla == "on",
        common_flags.ROUNDS.value,
        common_flags.STEPS_PER_ROUND.value,
        common_flags.WARMUP_STEPS.value,
        common_flags.BATCH_SIZE.value if is_lm else options.image_batch_size,
        common_flags.SEQUENCE_LENGTH.value,
        common_flags.NUM_LAYERS.value,
        common_flags.D_MODEL.value,
    )
    result["run"] = run
    harness.report(result, lines(result), common_flags.OUTPUT.value)
    if options.add_to:
        ablation_table.add_cell(options.add_to, result)


if __name__ == "__main__":
    _define_flags()
    app.run(main)
