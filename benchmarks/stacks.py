"""The stacks the benchmarks compare: stock Keras, and ours piece by piece.

    stock                   the global policy; `keras.optimizers.LossScaleOptimizer` in
                            `mixed_float16`, else the plain optimizer; `model.compile`
    train_step              `xla.compile_model`: the toolkit's train step (TensorFlow's; on
                            Keras' JAX backend `model.compile` gives our step with our
                            optimizer: `scaling.compile_hook`)
    loss_scale_optimizer    `mpt_keras.LossScaleOptimizer`: dynamic in `mixed_float16`,
                            else a fixed scale of 1 that still skips non-finite steps
    manifest                `PrecisionManifest(default=precision)`: the safe defaults
    monitor                 a `MixedPrecisionMonitor` at its default `update_freq`

Stock plus every piece, in this order, is `mpt-bench`'s `ours`. Every stack trains
with AdamW(1e-3) and the loss it is given.
"""

from __future__ import annotations

from collections.abc import Collection
from typing import Any

import keras

from mpt_keras.backend import current
from mpt_keras.checks import refusal
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
    """Compiles `model` (built in the global policy `precision`) with stock Keras and `pieces`;
    returns the callbacks to train with.

    Args:
        pieces: Of `PIECES`: none is stock Keras, all is ours.
        log_dir, examples_per_step: The monitor's directory and batch size.
        float8_layers: Paths of layers to train in float8, after the manifest
            (whose policies would turn float8 off).

    Raises:
        UserInputError: For a piece not in `PIECES`, or a float8 layer that
            `to_float8` refuses.
    """
    unknown = sorted(set(pieces) - set(PIECES))
    if unknown:
        raise refusal("pieces", repr(unknown[0]), ", ".join(PIECES))
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
    if "train_step" in pieces and not current.is_jax():
        from mpt_keras.execution import xla

        xla.compile_model(model, optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    else:
        model.compile(optimizer=optimizer, loss=loss, jit_compile=jit_compile)
    if "monitor" not in pieces:
        return []
    return [MixedPrecisionMonitor(log_dir, examples_per_step=examples_per_step)]
