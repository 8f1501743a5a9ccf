"""Every train step with our optimizer logs its state: in `History`, `CSVLogger` and batch hooks.

The batches are chosen so that each step's values are known in advance: a
finite batch, a batch holding a NaN (a bad batch: skipped, the scale kept),
a finite batch so large that the loss overflows (skipped, the scale halved),
and a finite batch again.
"""

import csv

import keras
import numpy as np
import pytest

from mpt_keras.execution import xla
from mpt_keras.precision.float8 import float8_statistics, to_float8
from mpt_keras.scaling.optimizer import LossScaleOptimizer

BATCH = 2
# Per step: loss_scale, skipped_steps, bad_batches.
EXPECTED = [(1024.0, 0.0, 0.0), (1024.0, 1.0, 1.0), (512.0, 2.0, 1.0), (512.0, 2.0, 1.0)]


def _model(compile_with: str) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1, name="out")], name="net")
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=1024.0, growth_interval=100
    )
    if compile_with == "compile":
        model.compile(optimizer=optimizer, loss="mse")
    else:
        xla.compile_model(
            model, optimizer=optimizer, loss="mse", jit_compile=compile_with == "compile_model_xla"
        )
    return model


def _data() -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(0).normal(size=(4 * BATCH, 3)).astype("float32")
    x[1 * BATCH] = np.nan
    x[2 * BATCH] = 1e30
    return x, np.ones((4 * BATCH, 1), "float32")


@pytest.mark.parametrize("compile_with", ["compile", "compile_model", "compile_model_xla"])
def test_each_step_logs_the_scale_skips_bad_batches_and_norm(tmp_path, compile_with):
    model = _model(compile_with)
    batch_logs = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_logs.append(dict(logs))
    )
    csv_path = tmp_path / "log.csv"
    history = model.fit(
        *_data(),
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[record, keras.callbacks.CSVLogger(str(csv_path))],
    )

    got = [(logs["loss_scale"], logs["skipped_steps"], logs["bad_batches"]) for logs in batch_logs]
    assert got == EXPECTED
    norms = [logs["gradient_norm"] for logs in batch_logs]
    assert np.isfinite(norms[0]) and np.isfinite(norms[3])
    assert not np.isfinite(norms[1]) and not np.isfinite(norms[2])
    assert {key: values[-1] for key, values in history.history.items() if key != "loss"} == {
        "loss_scale": 512.0,
        "skipped_steps": 2.0,
        "bad_batches": 1.0,
        "gradient_norm": norms[3],
    }
    with open(csv_path, newline="") as file:
        [row] = list(csv.DictReader(file))
    assert (row["loss_scale"], row["skipped_steps"], row["bad_batches"]) == ("512.0", "2.0", "1.0")


def test_a_model_without_our_optimizer_logs_only_its_metrics():
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer="sgd", loss="mse")
    history = model.fit(np.ones((4, 3)), np.ones((4, 1)), batch_size=2, verbose=0)
    assert list(history.history) == ["loss"]


@pytest.mark.parametrize("compile_with", ["compile", "compile_model_xla"])
def test_a_float8_model_logs_its_largest_range_used_each_step(compile_with):
    """The scale doubles every step: the output gradient's amax outgrows its delayed scale."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="hidden", dtype="mixed_float16"),
            keras.layers.Dense(1, name="out"),
        ]
    )
    to_float8(model, ["hidden"])
    optimizer = LossScaleOptimizer(
        keras.optimizers.SGD(0.01), initial_scale=16.0, growth_interval=1
    )
    if compile_with == "compile":
        model.compile(optimizer=optimizer, loss="mse")
    else:
        xla.compile_model(model, optimizer=optimizer, loss="mse", jit_compile=True)
    logged, read = [], []

    def on_batch_end(batch, logs):
        logged.append(logs["float8_range_used"])
        # The same figure read eagerly from the layer's variables.
        (layer,) = float8_statistics(model).values()
        read.append(
            max(state.range_used for state in (layer.inputs, layer.kernel, layer.outputs_grad))
        )

    x = np.random.default_rng(0).normal(size=(4 * BATCH, 3)).astype("float32")
    model.fit(
        x,
        np.ones((4 * BATCH, 1), "float32"),
        batch_size=BATCH,
        shuffle=False,
        verbose=0,
        callbacks=[keras.callbacks.LambdaCallback(on_train_batch_end=on_batch_end)],
    )
    assert logged == pytest.approx(read, rel=1e-6)
    assert float(optimizer.dynamic_scale) == 16.0 * 2**4
    # Step 1 quantizes at the initial scale of 1; then each step's amax, the
    # loss scale doubled, outgrows the largest before it, which set the
    # scale: above 1, saturation.
    assert logged[0] < 0.01 and all(value > 1 for value in logged[1:]), logged
