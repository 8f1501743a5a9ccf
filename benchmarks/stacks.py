"""The stacks the benchmarks compare: stock Keras, and ours piece by piece.

    stock                   the global policy only; `keras.optimizers.LossScaleOptimizer`
                            in `mixed_float16`, the plain optimizer otherwise;
                            `model.compile(jit_compile=...)`; no callback

and the pieces of ours, in the order `benchmarks.stack_ablation` adds them:

    train_step              `xla.compile_model`: the toolkit's train step (bad-batch
                            check; with XLA, the whole step on one device)
    loss_scale_optimizer    `mpt_keras.LossScaleOptimizer`: dynamic loss scaling in
                            `mixed_float16`, else a fixed scale of 1 that still
                            skips non-finite steps (as `mpt-train` makes it)
    manifest                `PrecisionManifest(default=precision)` applied: the safe
                            defaults (normalization and the output layer in float32)
    monitor                 a `MixedPrecisionMonitor` at its default `update_freq`

With every piece it is the stack `mpt-bench` calls `ours`. Every stack trains with
AdamW(1e-3) and the loss it is given (the reference models': `models.REFERENCE_LOSS`),
and may train chosen layers in float8 (`mpt-bench --float8`).
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import keras

from mpt_keras.errors import UserInputError
from mpt_keras.execution import xla
from mpt_keras.precision.float8 import to_float8
from mpt_keras.precision.manifest import PrecisionManifest
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry.monitor import MixedPrecisionMonitor

PIECES = ("train_step", "loss_scale_optimizer", "manifest", "monitor")


def compile_stack(
    model: keras.Model,
    precision: str,
    jit_compile: bool,
    pieces: Collection[str],
    log_dir: str,
    examples_per_step: int,
    *,
    loss: Any,
    float8_layers: Collection[str] = (),
) -> list[keras.callbacks.Callback]:
    """Compiles `model` (built in the global policy `precision`) with stock Keras and `pieces`.

    Args:
        model: A built model, not yet compiled.
        precision: The global dtype policy it was built in.
        jit_compile: Whether to compile with XLA.
        pieces: Which of `PIECES` to use: none is stock Keras, all is ours.
        log_dir: The monitor's TensorBoard directory.
        examples_per_step: The batch size, for the monitor's throughput.
        loss: The loss to train with, as `model.compile` takes it
            (`models.REFERENCE_LOSS` for the reference models).
        float8_layers: Paths of layers to train in float8 (`to_float8`), after
            the manifest (whose policies would turn float8 off) and before the
            optimizer is built.

    Returns:
        The callbacks to train with.

    Raises:
        UserInputError: For a piece not in `PIECES`, or a float8 layer that
            `to_float8` refuses.
    """
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        raise UserInputError(f"unknown stack piece '{unknown[0]}'. Allowed: {', '.join(PIECES)}")
    if "manifest" in pieces:
        PrecisionManifest(default=precision).apply(model)
    if float8_layers:
        to_float8(model, float8_layers)
    inner = keras.optimizers.AdamW(1e-3)
    if "loss_scale_optimizer" in pieces:
        if precision == "mixed_float16":
            optimizer = LossScaleOptimizer(inner)
        else:
            optimizer = LossScaleOptimizer(
                inner, initial_scale=1.0, min_scale=1.0, max_scale=1.0, dynamic=False
            )
    elif precision == "mixed_float16":
        optimizer = keras.optimizers.LossScaleOptimizer(inner)
    else:
        optimizer = inner
    if "train_step" in pieces:
        xla.compile_model(model, optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    else:
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    if "monitor" not in pieces:
        return []
    return [MixedPrecisionMonitor(log_dir, examples_per_step=examples_per_step)]
