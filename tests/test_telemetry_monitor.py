"""Tests for mpt_keras.telemetry.monitor.MixedPrecisionMonitor and its TensorBoard dashboard.

Exact values come from a model with a "tripwire" layer whose own gradient is
infinite on the batches that carry a flag, and finite everywhere else, so the
steps that overflow, and the variable that does, are known in advance. One test reads
a `run_training` run back through a real TensorBoard server.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request

import keras
import numpy as np
import pytest
import tensorflow as tf
from replicas import on_two_cpus, run_on_two_cpus, two_cpu_strategy
from tensorboard.plugins.custom_scalar import layout_pb2, metadata

from mpt_keras.backend.tensorflow import workers
from mpt_keras.config import TrainConfig
from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import float8_statistics, to_float8
from mpt_keras.runs.training import Runtime, run_training
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry.monitor import MixedPrecisionMonitor

# Its two-replica cases run in the two-CPU host (tests/replicas.py).
pytestmark = on_two_cpus

BATCH_SIZE = 4


class _Tripwire(keras.layers.Layer):
    """Passes the features on; the gradient of its `gain` is infinite on flagged rows.

    Inputs are `[features..., flag]`; it adds flag * sqrt(gain + 1 - flag),
    which is 0 on every row while gain = 0. Its gradient in gain is
    flag / (2 sqrt(gain + 1 - flag)): 0 on unflagged rows (so gain stays 0) and
    1 / 0 on flagged ones.
    """

    def build(self, input_shape):
        self.gain = self.add_weight(shape=(), initializer="zeros", name="gain")

    def call(self, inputs):
        features, flag = inputs[:, :-1], inputs[:, -1:]
        return features + flag * keras.ops.sqrt(self.gain + 1.0 - flag)


def _tripwire_model(optimizer=None, jit_compile=False):
    model = keras.Sequential(
        [keras.Input((3,)), _Tripwire(name="tripwire"), keras.layers.Dense(2, name="head")],
        name="net",
    )
    model.compile(
        optimizer=optimizer
        or LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0, growth_interval=100),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=jit_compile,
    )
    return model


def _data(steps, flagged_steps=()):
    """`steps` batches; each flagged step (1-based) has one flagged row."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(steps * BATCH_SIZE, 3)).astype("float32")
    x[:, -1] = 0.0
    for step in flagged_steps:
        x[(step - 1) * BATCH_SIZE, -1] = 1.0
    y = rng.integers(0, 2, size=(steps * BATCH_SIZE,))
    return x, y


def _fit(model, monitor, steps, flagged_steps=()):
    x, y = _data(steps, flagged_steps)
    model.fit(x, y, batch_size=BATCH_SIZE, epochs=1, shuffle=False, callbacks=[monitor], verbose=0)


def _events(event_dir):
    """`{tag: [(step, value)]}`: floats for scalars, strings for text, arrays otherwise."""
    values = {}
    for path in sorted(glob.glob(os.path.join(event_dir, "events.out.tfevents.*"))):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                array = tf.make_ndarray(value.tensor)
                if array.dtype == object:
                    array = array.item().decode()
                elif array.ndim == 0:
                    array = float(array)
                values.setdefault(value.tag, []).append((event.step, array))
    return values


def _chart_regexes(log_dir):
    """`{chart title: its tag regex}` of the dashboard written in `log_dir`."""
    for path in glob.glob(os.path.join(log_dir, "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for value in event.summary.value:
                if value.tag == metadata.CONFIG_SUMMARY_TAG:
                    layout = layout_pb2.Layout.FromString(tf.make_ndarray(value.tensor).item())
                    [category] = layout.category
                    return {chart.title: chart.multiline.tag[0] for chart in category.chart}
    raise AssertionError(f"no dashboard in {log_dir}")


def _warnings(caplog):
    return [
        record.getMessage()
        for record in caplog.records
        if record.name == "mpt_keras.telemetry.monitor" and record.levelno == logging.WARNING
    ]


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "jit"])
def test_loss_scale_skips_and_nonfinite_counts_at_the_exact_steps(tmp_path, caplog, jit_compile):
    model = _tripwire_model(jit_compile=jit_compile)
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=2, examples_per_step=BATCH_SIZE)
    with caplog.at_level(logging.WARNING, logger="mpt_keras.telemetry.monitor"):
        _fit(model, monitor, steps=6, flagged_steps=(3, 4))

    train = _events(str(tmp_path / "train"))
    # Each skipped step halves the scale; no growth within 100 steps.
    assert train["loss_scale"] == [(2, 1024.0), (4, 256.0), (6, 256.0)]
    assert train["skipped_steps"] == [(2, 0.0), (4, 2.0), (6, 2.0)]
    assert train["overflow_rate"] == [(2, 0.0), (4, 1.0), (6, 0.0)]
    assert [tag for tag in train if tag.startswith("nonfinite/")] == ["nonfinite/net/tripwire/gain"]
    assert train["nonfinite/net/tripwire/gain"] == [(4, 2.0)]
    [(step, text)] = train["nonfinite_gradients"]
    assert step == 4
    assert text.splitlines() == [
        "**Step 4**: 2 of steps 3-4 skipped for non-finite gradients, in layers net/tripwire.",
        "",
        "| layer | variable | non-finite steps in the interval | in total |",
        "|---|---|---|---|",
        "| net/tripwire | net/tripwire/gain | 2 | 2 |",
    ]
    assert _warnings(caplog) == [
        "Step 4: 2 of steps 3-4 skipped for non-finite gradients; layers: net/tripwire; "
        "variables: net/tripwire/gain"
    ]

    # The first step traces and is not timed; every interval has timed steps.
    assert [step for step, _ in train["step_time_seconds"]] == [2, 4, 6]
    for (_, seconds), (_, rate) in zip(train["step_time_seconds"], train["examples_per_second"]):
        assert seconds > 0
        assert rate == pytest.approx(BATCH_SIZE / seconds, rel=1e-6)
    assert [step for step, _ in train["peak_memory_mib/CPU:0"]] == [2, 4, 6]
    assert all(mib >= 0 for _, mib in train["peak_memory_mib/CPU:0"])
    # Written at every interval; non-finite at step 4, whose gradients overflowed.
    assert [step for step, _ in train["gradient_norm"]] == [2, 4, 6]
    assert not np.isfinite(train["gradient_norm"][1][1])
    # No float8 layer: no float8 tag, no float8 chart.
    assert not [tag for tag in train if tag.startswith("float8/")]
    assert not [title for title in _chart_regexes(str(tmp_path)) if "float8" in title.lower()]


@pytest.mark.usefixtures("no_memory_statistics")
def test_a_device_without_memory_statistics_gets_no_memory_tag(tmp_path):
    _fit(_tripwire_model(), MixedPrecisionMonitor(str(tmp_path), update_freq=2), steps=4)
    train = _events(str(tmp_path / "train"))
    assert [step for step, _ in train["loss_scale"]] == [2, 4]
    assert not [tag for tag in train if tag.startswith("peak_memory_mib")]


def test_an_overflow_after_the_last_interval_is_reported_at_the_end(tmp_path, caplog):
    model = _tripwire_model()
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=4)
    with caplog.at_level(logging.WARNING, logger="mpt_keras.telemetry.monitor"):
        _fit(model, monitor, steps=6, flagged_steps=(6,))

    train = _events(str(tmp_path / "train"))
    assert train["skipped_steps"] == [(4, 0.0), (6, 1.0)]
    assert train["overflow_rate"] == [(4, 0.0), (6, 0.5)]
    assert train["nonfinite/net/tripwire/gain"] == [(6, 1.0)]
    assert [step for step, _ in train["nonfinite_gradients"]] == [6]
    assert _warnings(caplog) == [
        "Step 6: 1 of steps 5-6 skipped for non-finite gradients; layers: net/tripwire; "
        "variables: net/tripwire/gain"
    ]


def _train_mirrored(log_dir):
    """The run of the exact-steps test on two replicas, with histograms at the end."""
    strategy = two_cpu_strategy()
    with strategy.scope():
        model = _tripwire_model()
    monitor = MixedPrecisionMonitor(
        log_dir, update_freq=2, histogram_freq=6, histogram_data=_data(1)
    )
    # The flagged row of a batch is on replica 0; replica 1 sees finite gradients.
    _fit(model, monitor, steps=6, flagged_steps=(3, 4))


def test_two_replicas_write_the_single_device_values(tmp_path):
    # Two replicas need the CPU split before TensorFlow initializes its devices.
    run_on_two_cpus("test_telemetry_monitor", "_train_mirrored", str(tmp_path))

    train = _events(str(tmp_path / "train"))
    assert train["loss_scale"] == [(2, 1024.0), (4, 256.0), (6, 256.0)]
    assert train["skipped_steps"] == [(2, 0.0), (4, 2.0), (6, 2.0)]
    assert train["overflow_rate"] == [(2, 0.0), (4, 1.0), (6, 0.0)]
    assert train["nonfinite/net/tripwire/gain"] == [(4, 2.0)]
    assert [step for step, _ in train["nonfinite_gradients"]] == [4]
    assert {"peak_memory_mib/CPU:0", "peak_memory_mib/CPU:1"} <= set(train)
    # The histogram pass runs on the chief's model, outside the replicas.
    assert [step for step, _ in train["activation_log2_magnitude/tripwire"]] == [6]
    assert [step for step, _ in train["gradient_log2_magnitude/net/head/kernel"]] == [6]


def test_counts_resume_from_the_optimizer_state(tmp_path):
    # A second fit (as after a restart) starts from the optimizer's counters,
    # so an overflow of the first fit is not reported again.
    model = _tripwire_model()
    _fit(model, MixedPrecisionMonitor(str(tmp_path / "first"), update_freq=2), 2, (1,))
    _fit(model, MixedPrecisionMonitor(str(tmp_path / "second"), update_freq=2), 4, (2,))

    train = _events(str(tmp_path / "second" / "train"))
    assert train["skipped_steps"] == [(4, 2.0), (6, 2.0)]
    assert train["overflow_rate"] == [(4, 0.5), (6, 0.0)]
    assert train["nonfinite/net/tripwire/gain"] == [(4, 2.0)]


def test_gradient_norm_is_read_from_the_optimizer(tmp_path):
    # With a learning rate of 0 the weights stay put, so every step has the
    # gradient of the same batch.
    optimizer = LossScaleOptimizer(keras.optimizers.SGD(0.0), initial_scale=1024.0)
    model = _tripwire_model(optimizer)
    x, y = _data(1)
    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=2)
    model.fit(
        np.tile(x, (3, 1)),
        np.tile(y, 3),
        batch_size=BATCH_SIZE,
        shuffle=False,
        callbacks=[monitor],
        verbose=0,
    )

    with tf.GradientTape() as tape:
        loss = model.compute_loss(x=x, y=y, y_pred=model(x), training=False)
    expected = tf.linalg.global_norm(tape.gradient(loss, model.trainable_variables))
    norms = _events(str(tmp_path / "train"))["gradient_norm"]
    assert [step for step, _ in norms] == [2, 3]
    np.testing.assert_allclose([norm for _, norm in norms], [float(expected)] * 2, rtol=1e-5)


def test_histograms_place_values_against_the_float16_range(tmp_path):
    # One unit weight: the activations are the first input column.
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(1, use_bias=False, kernel_initializer="ones", name="dense"),
        ],
        name="net",
    )
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.0)), loss="mse")
    sample_x = np.array([[1e5, 0], [1e-6, 0], [4.0, 0], [0, 0]], "float32")
    sample_y = np.zeros((4, 1), "float32")
    monitor = MixedPrecisionMonitor(
        str(tmp_path), update_freq=10, histogram_freq=2, histogram_data=(sample_x, sample_y)
    )
    model.fit(
        np.ones((12, 2), "float32"),
        np.zeros((12, 1)),
        batch_size=4,
        callbacks=[monitor],
        verbose=0,
    )

    train = _events(str(tmp_path / "train"))
    assert train["activation_above_float16_max/dense"] == [(2, 0.25)]
    assert train["activation_below_float16_normal/dense"] == [(2, 0.25)]
    [(step, histogram)] = train["activation_log2_magnitude/dense"]
    assert step == 2
    # Rows of (left edge, right edge, count): the three nonzero values, from
    # log2(1e-6) to log2(1e5).
    assert histogram[:, 2].sum() == 3
    np.testing.assert_allclose([histogram[0, 0], histogram[-1, 1]], np.log2([1e-6, 1e5]), rtol=1e-5)
    # d(scale * mean(a**2))/d kernel = scale * mean(2 * a * x): the 1e5 row gives
    # 2**15 * 2 * 1e10 / 4, far above the float16 max; the kernel's row for the
    # zero column has a gradient of 0.
    assert train["gradient_above_float16_max/net/dense/kernel"] == [(2, 0.5)]
    assert train["gradient_below_float16_normal/net/dense/kernel"] == [(2, 0.0)]
    assert "gradient_log2_magnitude/net/dense/kernel" in train


class _Float8Reader(keras.callbacks.Callback):
    """Reads the float8 layer `hidden`'s variables and statistics after every train step.

    Not `async_safe`: with it, Keras runs every callback's batch hooks in step.
    """

    def __init__(self):
        super().__init__()
        self.variables, self.statistics = [], []

    def on_train_batch_end(self, batch, logs=None):
        layer = self.model.get_layer("hidden")
        self.variables.append(
            {
                f"{tensor}/{name}": float(read(getattr(layer, f"{tensor}_{variable}").numpy()))
                for tensor in ("inputs", "kernel", "outputs_grad")
                for name, variable, read in (
                    ("scale", "scale", float),
                    ("amax", "amax_history", lambda history: history[0]),
                )
            }
        )
        self.statistics.append(float8_statistics(self.model)["hidden"].scalars())


FLOAT8_STATISTICS = [
    f"{tensor}/{statistic}"
    for tensor in ("inputs", "kernel", "outputs_grad")
    for statistic in ("scale", "amax", "range_used")
] + ["kernel/saturated", "kernel/underflowed"]


def test_a_float8_layers_scales_amax_and_shares_are_written_at_each_interval(tmp_path):
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((3,)),
            keras.layers.Dense(4, name="hidden"),
            keras.layers.Dense(2, name="head"),
        ],
        name="net",
    )
    assert to_float8(model, ["hidden"]) == ("hidden",)
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1024.0),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    x, y = _data(4)
    reader = _Float8Reader()
    monitor = MixedPrecisionMonitor(
        str(tmp_path), update_freq=2, histogram_freq=4, histogram_data=(x[:4], y[:4])
    )
    model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0, callbacks=[monitor, reader])

    train = _events(str(tmp_path / "train"))
    float8_tags = [f"float8/hidden/{statistic}" for statistic in FLOAT8_STATISTICS]
    assert sorted(tag for tag in train if tag.startswith("float8/")) == sorted(float8_tags)
    for statistic in FLOAT8_STATISTICS:
        # As float32: the values after steps 2 and 4.
        expected = [
            (step, float(np.float32(reader.statistics[step - 1][statistic]))) for step in (2, 4)
        ]
        assert train[f"float8/hidden/{statistic}"] == expected, statistic
    for step in (2, 4):
        variables = reader.variables[step - 1]
        assert {name: reader.statistics[step - 1][name] for name in variables} == variables
    assert reader.variables[1]["inputs/amax"] == np.abs(x[4:8]).max(initial=0.0)
    assert reader.variables[3]["inputs/amax"] > 0 and reader.variables[3]["outputs_grad/amax"] > 0

    # The histograms leave out the float8 state, whose "gradient" is its new value.
    gradients = sorted(tag for tag in train if tag.startswith("gradient_log2_magnitude/"))
    assert gradients == [
        f"gradient_log2_magnitude/net/{layer}/{weight}"
        for layer in ("head", "hidden")
        for weight in ("bias", "kernel")
    ]

    charts = _chart_regexes(str(tmp_path))
    float8_charts = {title: regex for title, regex in charts.items() if title.startswith("Float8")}
    assert float8_charts == {
        "Float8 scales": "^float8/.*/scale$",
        "Float8 amax at the last step": "^float8/.*/amax$",
        "Float8 range used: amax over the largest value at its scale": "^float8/.*/range_used$",
        "Float8 kernel values saturated at its scale (share)": "^float8/.*/saturated$",
        "Float8 kernel values underflowed to zero at its scale (share)": "^float8/.*/underflowed$",
    }
    for tag in float8_tags:  # Each on exactly one chart.
        assert sum(bool(re.match(regex, tag)) for regex in charts.values()) == 1, tag


def test_a_non_chief_worker_writes_and_logs_nothing(tmp_path, caplog, monkeypatch):
    # Which task is chief: `workers.is_chief`'s own tests.
    monkeypatch.setattr(workers, "is_chief", lambda strategy: False)
    log_dir = tmp_path / "logs"
    with caplog.at_level(logging.WARNING, logger="mpt_keras.telemetry.monitor"):
        _fit(_tripwire_model(), MixedPrecisionMonitor(str(log_dir), update_freq=2), 4, (1,))
    assert not log_dir.exists()
    assert _warnings(caplog) == []


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"update_freq": 0}, "update_freq: received 0. Allowed: an integer >= 1"),
        ({"diagnosis_every": 0}, "diagnosis_every: received 0. Allowed: an integer >= 1"),
        ({"histogram_freq": -1}, "histogram_freq: received -1. Allowed: an integer >= 0"),
        ({"examples_per_step": 2.5}, "examples_per_step: received 2.5. Allowed: an integer >= 1"),
        (
            {"histogram_freq": 5},
            "histogram_data: received None. Allowed: (x, y), a batch to take the histograms "
            "on, with histogram_freq=5",
        ),
    ],
)
def test_bad_arguments_say_what_is_allowed(arguments, message):
    with pytest.raises(UserInputError) as raised:
        MixedPrecisionMonitor("/tmp/unused", **arguments)
    assert str(raised.value) == message


def _free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _get_json(base, route, **query):
    url = f"{base}{route}?{urllib.parse.urlencode(query)}" if query else base + route
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.load(response)


def _wait_for_tags(base, server, server_log, run, tag, timeout=60.0):
    """The scalar tags, once TensorBoard has loaded `run`'s `tag`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert server.poll() is None, server_log.read_text()
        try:
            tags = _get_json(base, "/data/plugin/scalars/tags")
            if tag in tags.get(run, {}):
                return tags
        except (urllib.error.URLError, ConnectionError):
            pass  # Not serving yet.
        time.sleep(0.5)
    raise AssertionError(f"TensorBoard did not load {run}/{tag} within {timeout} s")


def test_tensorboard_serves_the_run(tfds_dir, tmp_path):
    # A float16 run at a scale of 2**24: its first steps overflow.
    model_dir = str(tmp_path / "run")
    config = TrainConfig.from_dict(
        {
            "precision": "mixed_float16",
            "steps": 6,
            "checkpoint_every": 3,
            "eval_every": 3,
            "log_every": 2,
            "loss_scale": {"initial_scale": 2.0**24, "max_scale": 2.0**24},
            "data": {
                "name": "mpt_digits",
                "data_dir": tfds_dir,
                "batch_size": 16,
                "eval_examples": 64,
            },
            "model": {"name": "mlp", "options": {"hidden_units": [16]}},
        }
    )
    metrics = run_training(config, Runtime(model_dir, verbose=0))
    assert metrics["skipped_steps"] >= 1

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    server_log = tmp_path / "tensorboard.log"
    with open(server_log, "w") as log:
        # To a file: a full pipe would stall the server.
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                f"--logdir={os.path.join(model_dir, 'logs')}",
                f"--port={port}",
                "--host=127.0.0.1",
                "--load_fast=false",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        tags = _wait_for_tags(base, server, server_log, "train", "overflow_rate")
        assert {
            "loss",
            "accuracy",
            "learning_rate",
            "loss_scale",
            "skipped_steps",
            "overflow_rate",
            "step_time_seconds",
            "peak_memory_mib/CPU:0",
        } <= set(tags["train"])
        assert {"loss", "accuracy"} <= set(tags["validation"])
        nonfinite = sorted(tag for tag in tags["train"] if tag.startswith("nonfinite/"))
        assert nonfinite

        def series(tag):
            points = _get_json(base, "/data/plugin/scalars/scalars", run="train", tag=tag)
            return [(step, value) for _, step, value in points]

        skipped = metrics["skipped_steps"]
        assert series("loss_scale")[-1] == (6, metrics["loss_scale"])
        assert series("skipped_steps")[-1] == (6, skipped)
        assert sum(rate * 2 for _, rate in series("overflow_rate")) == skipped

        assert "nonfinite_gradients" in _get_json(base, "/data/plugin/text/tags")["train"]
        events = _get_json(base, "/data/plugin/text/text", run="train", tag="nonfinite_gradients")
        # Rendered from Markdown: the variables whose counts went up, and their layers.
        text = " ".join(event["text"] for event in events)
        for tag in nonfinite:
            assert tag.removeprefix("nonfinite/") in text

        layout = _get_json(base, "/data/plugin/custom_scalars/layout")
        [category] = layout["category"]
        assert category["title"] == "Mixed precision"
        charts = {chart["title"]: chart["multiline"]["tag"] for chart in category["chart"]}
        assert charts["Loss scale"] == ["^loss_scale$"]
        assert charts["Overflow rate (skipped / steps, per interval)"] == ["^overflow_rate$"]
        assert charts["Peak device memory per interval (MiB)"] == ["^peak_memory_mib/"]
        assert len(charts) == 8
    finally:
        server.kill()
        server.wait()


@pytest.mark.parametrize("jit_compile", [False, True], ids=["graph", "jit"])
def test_a_step_skipped_at_the_scale_floor_is_diagnosed_on_its_batch(tmp_path, caplog, jit_compile):
    # A fixed scale: every overflow is at the floor. Steps 3 and 4 overflow;
    # one diagnosis per 100 steps.
    fixed = LossScaleOptimizer(keras.optimizers.SGD(0.1), initial_scale=1.0, dynamic=False)
    model = _tripwire_model(fixed, jit_compile=jit_compile)
    x, y = _data(6, flagged_steps=(3, 4))
    batches = []

    def batch_of_step(step):
        batches.append(step)
        rows = slice((step - 1) * BATCH_SIZE, step * BATCH_SIZE)
        return x[rows], y[rows]

    monitor = MixedPrecisionMonitor(str(tmp_path), update_freq=2, diagnosis_data=batch_of_step)
    with caplog.at_level(logging.WARNING, logger="mpt_keras.telemetry.monitor"):
        model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0, callbacks=[monitor])
    assert batches == [3]
    line = "step 3: first non-finite gradient: net/tripwire/gain"
    assert _warnings(caplog)[0] == line
    assert _events(str(tmp_path / "train"))["nonfinite_diagnosis"] == [(3, line)]


def test_a_bad_batch_is_diagnosed_as_non_finite_inputs(tmp_path, caplog):
    model = _tripwire_model()
    x, y = _data(4)
    x[BATCH_SIZE + 1, 0] = np.nan  # Step 2.
    monitor = MixedPrecisionMonitor(str(tmp_path), diagnosis_data=(x[BATCH_SIZE:], y[BATCH_SIZE:]))
    with caplog.at_level(logging.WARNING, logger="mpt_keras.telemetry.monitor"):
        model.fit(x, y, batch_size=BATCH_SIZE, shuffle=False, verbose=0, callbacks=[monitor])
    assert _warnings(caplog) == [
        "step 2: first non-finite output: tripwire (float32), input max 2.3, "
        "its inputs already non-finite"
    ]
