"""The telemetry and reliability callbacks on Keras' JAX backend (no TensorFlow)."""

from __future__ import annotations

import csv
import socket
import urllib.request
from typing import Any

import keras
import numpy as np
import pytest

from mpt_keras import BadBatchLimit, LossScaleOptimizer, MetricsCsv, PrometheusExporter
from mpt_keras.errors import RunStoppedError


def _model() -> keras.Model:
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([np.ones((3, 1), "float32"), np.zeros((1,), "float32")])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    return model


def _data(nan_rows: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.RandomState(0).normal(size=(16, 3)).astype("float32")
    for row in nan_rows:
        x[row, 0] = np.nan
    return x, np.ones((16, 1), "float32")


def test_metrics_csv_writes_a_row_per_interval_with_the_loss_scaling_state(tmp_path):
    path = tmp_path / "metrics.csv"
    model = _model()
    model.fit(
        *_data((5,)),
        batch_size=4,
        shuffle=False,
        verbose=0,
        callbacks=[MetricsCsv(str(path), every=2)],
    )
    with open(path, newline="") as file:
        rows = list(csv.DictReader(file))
    assert [int(row["step"]) for row in rows] == [2, 4]
    assert [float(row["skipped_steps"]) for row in rows] == [1.0, 1.0]
    assert [float(row["bad_batches"]) for row in rows] == [1.0, 1.0]
    assert float(rows[-1]["loss_scale"]) == 2.0**15


def test_bad_batch_limit_stops_the_run_on_jax():
    with pytest.raises(RunStoppedError, match="3 train batches held NaN or Inf values"):
        _model().fit(
            *_data((1, 5, 9)),
            batch_size=4,
            shuffle=False,
            verbose=0,
            callbacks=[BadBatchLimit(max_bad_batches=2, check_every=1)],
        )


def test_prometheus_serves_the_loss_scale_on_jax():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    exporter = PrometheusExporter(port, run_name="jax", update_every=1, address="127.0.0.1")
    _model().fit(*_data(), batch_size=4, shuffle=False, verbose=0, callbacks=[exporter])
    page = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert 'mpt_loss_scale{run="jax"} 32768.0' in page


def test_a_models_own_train_step_is_kept_and_its_logs_get_the_loss_scaling_state():
    class Counting(keras.Sequential):
        steps = 0

        def train_step(self, state, data):
            Counting.steps += 1  # Counted where traced: once per compilation.
            return super().train_step(state, data)

    model = Counting([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    history = model.fit(*_data(), batch_size=4, verbose=0)
    assert Counting.steps >= 1
    assert history.history["loss_scale"] == [2.0**15]
    assert history.history["skipped_steps"] == [0.0]


def _tensors(log_dir: str) -> dict[str, list[tuple[int, Any]]]:
    from tensorboard.backend.event_processing import event_accumulator
    from tensorboard.util import tensor_util

    events = event_accumulator.EventAccumulator(log_dir, size_guidance={"tensors": 0})
    events.Reload()
    return {
        tag: [(e.step, tensor_util.make_ndarray(e.tensor_proto)) for e in events.Tensors(tag)]
        for tag in events.Tags()["tensors"]
    }


def test_the_monitor_writes_its_scalars_and_overflow_report_with_tensorboards_writer(tmp_path):
    from mpt_keras import MixedPrecisionMonitor

    model = _model()
    x, y = _data()
    x[4:8] *= 1e30  # The second batch's gradient overflows float32: skipped, scale halved.
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=2, examples_per_step=4)
    model.fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[monitor])
    train = _tensors(str(tmp_path / "train"))
    assert [step for step, _ in train["loss_scale"]] == [2, 4]
    assert [float(v) for _, v in train["loss_scale"]] == [2.0**14, 2.0**14]
    assert [float(v) for _, v in train["skipped_steps"]] == [1.0, 1.0]
    assert [float(v) for _, v in train["overflow_rate"]] == [0.5, 0.0]
    assert "step_time_seconds" in train and "learning_rate" in train
    report = train["nonfinite_gradients"][0]
    assert report[0] == 2 and b"sequential/dense/kernel" in report[1].item()
    assert "custom_scalars__config__" in _tensors(str(tmp_path))


def test_the_monitors_histograms_are_one_line_on_jax(tmp_path):
    from mpt_keras import MixedPrecisionMonitor
    from mpt_keras.errors import UserInputError

    with pytest.raises(UserInputError) as raised:
        MixedPrecisionMonitor(str(tmp_path), histogram_freq=1, histogram_data=_data())
    assert str(raised.value) == (
        "MixedPrecisionMonitor on Keras' JAX backend: received histogram_freq=1. Allowed: "
        "histogram_freq=0: the histograms trace the model with TensorFlow (docs/backends.md)"
    )


def test_the_monitor_diagnoses_a_bad_batch_on_its_step(tmp_path, caplog):
    from mpt_keras import MixedPrecisionMonitor

    x, y = _data((5,))  # The second batch of four holds a NaN.

    def batch_of(step: int) -> tuple[np.ndarray, np.ndarray]:
        return x[4 * step - 4 : 4 * step], y[:4]

    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=4, diagnosis_data=batch_of)
    with caplog.at_level("WARNING"):
        _model().fit(x, y, batch_size=4, shuffle=False, verbose=0, callbacks=[monitor])
    diagnoses = _tensors(str(tmp_path / "train"))["nonfinite_diagnosis"]
    assert [step for step, _ in diagnoses] == [2]
    line = diagnoses[0][1].item().decode()
    assert line == (
        "step 2: first non-finite output: dense (float32), input max 2.6, its inputs already "
        "non-finite"
    )
    assert line in caplog.text


def test_diagnose_nonfinite_names_the_float16_layer_and_the_first_nonfinite_gradient():
    from mpt_keras import diagnose_nonfinite

    keras.mixed_precision.set_global_policy("float32")
    inputs = keras.Input((3,))
    big = keras.layers.Dense(2, name="big")(inputs)
    out = keras.layers.Dense(1, name="half", dtype="float16")(big)
    model = keras.Model(inputs, out)
    model.set_weights([np.full((3, 2), 1e4, "float32"), np.zeros(2, "float32"),
                       np.ones((2, 1), "float32"), np.zeros(1, "float32")])  # fmt: skip
    report = diagnose_nonfinite(model, np.full((1, 3), 3.0, "float32"))
    assert (report.first_layer, report.compute_dtype) == ("half", "float16")
    assert report.input_max == 9e4 and report.inputs_finite  # 3 x 3.0 x 1e4, over 65504.

    model = _model()
    # A finite forward pass (3e38); the scaled loss's gradient, 2 x 3e38 x 2**15, is not.
    model.set_weights([np.full((3, 1), 1e38, "float32"), np.zeros(1, "float32")])
    report = diagnose_nonfinite(model, np.ones((2, 3), "float32"), np.zeros((2, 1), "float32"))
    assert report.first_layer is None
    assert report.first_nonfinite_gradient == "sequential/dense/kernel"


def test_the_serving_file_is_written_on_jax_and_the_saved_model_needs_tensorflow(tmp_path):
    from mpt_keras import export_saved_model, save_for_serving

    keras.mixed_precision.set_global_policy("mixed_float16")
    model = _model()
    model.fit(*_data(), batch_size=4, verbose=0)
    path = str(tmp_path / "serving.keras")
    save_for_serving(model, path)
    keras.mixed_precision.set_global_policy("float32")
    served = keras.models.load_model(path)
    assert not served.compiled and served.layers[0].compute_dtype == "float16"
    np.testing.assert_allclose(
        served.predict(np.ones((1, 3), "float32"), verbose=0),
        model.predict(np.ones((1, 3), "float32"), verbose=0),
    )
    with pytest.raises(ImportError, match="requires the tensorflow module"):  # Keras' line.
        export_saved_model(model, str(tmp_path / "saved_model"))
