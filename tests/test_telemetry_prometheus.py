"""Tests of mpt_keras.telemetry.prometheus: the endpoint scraped over HTTP during a run."""

import json
import os
import socket
import urllib.request

import keras
import numpy as np
import pytest
from tiny_runs import tiny_config

from mpt_keras.errors import UserInputError
from mpt_keras.precision.float8 import float8_statistics, to_float8
from mpt_keras.runs.training import Runtime, run_training
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry import prometheus
from mpt_keras.telemetry.prometheus import PrometheusExporter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _scrape(port: int) -> dict[str, float]:
    """`{series: value}` of the mpt_* samples the endpoint serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
        text = response.read().decode()
    samples = (line.rsplit(" ", 1) for line in text.splitlines() if line.startswith("mpt_"))
    return {name: float(value) for name, value in samples if "_created{" not in name}


class _Scraper(keras.callbacks.Callback):
    """Scrapes the endpoint at the end of the given train steps (counted from 1)."""

    def __init__(self, port, steps):
        super().__init__()
        self.port, self.steps, self.scrapes, self.step = port, steps, {}, 0

    def on_train_batch_end(self, batch, logs=None):
        self.step += 1
        if self.step in self.steps:
            self.scrapes[self.step] = _scrape(self.port)


def test_the_endpoint_serves_each_steps_figures_during_fit():
    port = _free_port()
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0),
        loss="mse",
    )
    x = np.random.default_rng(0).normal(size=(12, 3)).astype("float32")
    x[4] = np.nan  # Step 3 (batches of 2) is a bad batch.
    exporter = PrometheusExporter(port, run_name="tiny", examples_per_step=2, update_every=2)
    scraper = _Scraper(port, steps=(2, 6))
    try:
        model.fit(
            x,
            np.ones((12, 1)),
            batch_size=2,
            shuffle=False,
            verbose=0,
            callbacks=[exporter, scraper],
        )
    finally:
        exporter.close()
    run = '{run="tiny"}'
    first, last = scraper.scrapes[2], scraper.scrapes[6]
    assert first[f"mpt_train_steps_total{run}"] == 2.0
    assert last[f"mpt_train_steps_total{run}"] == 6.0
    assert (first[f"mpt_skipped_steps_total{run}"], last[f"mpt_skipped_steps_total{run}"]) == (
        0.0,
        1.0,
    )
    assert last[f"mpt_bad_batches_total{run}"] == 1.0
    assert last[f"mpt_nonfinite_events_total{run}"] == 0.0  # A bad batch is no overflow.
    assert last[f"mpt_loss_scale{run}"] == 1024.0
    assert last[f"mpt_examples_per_second{run}"] > 0
    assert np.isfinite(first[f"mpt_train_loss{run}"])  # Keras' own mean takes in the NaN batch.
    assert set(first) == {f"{name}{run}" for name in prometheus.GAUGES} | {
        f"{name}_total{run}" for name in prometheus.COUNTERS
    }


def test_a_float8_model_serves_each_layers_statistics_as_labelled_gauges():
    port = _free_port()
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((3,)), keras.layers.Dense(4, name="hidden"), keras.layers.Dense(1)]
    )
    to_float8(model, ["hidden"])
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.01), initial_scale=1024.0),
        loss="mse",
    )
    x = np.random.default_rng(0).normal(size=(8, 3)).astype("float32")
    exporter = PrometheusExporter(port, run_name="tiny", update_every=1)
    scraper = _Scraper(port, steps=(4,))  # The last step: the state `fit` leaves.
    try:
        model.fit(
            x,
            np.ones((8, 1)),
            batch_size=2,
            shuffle=False,
            verbose=0,
            callbacks=[exporter, scraper],
        )
    finally:
        exporter.close()
    gauge = prometheus.FLOAT8_GAUGE
    served = {
        series: value
        for series, value in scraper.scrapes[4].items()
        if series.startswith(gauge + "{")
    }
    statistics = float8_statistics(model)["hidden"].scalars()
    expected = {}
    for name, value in statistics.items():
        tensor, stat = name.split("/")
        # The exposition lists the labels sorted by name.
        expected[f'{gauge}{{layer="hidden",run="tiny",stat="{stat}",tensor="{tensor}"}}'] = value
    assert len(expected) == 11
    assert served == expected
    # Slot 0 of Keras' amax history: the largest input magnitude of the last batch.
    inputs_amax = f'{gauge}{{layer="hidden",run="tiny",stat="amax",tensor="inputs"}}'
    assert served[inputs_amax] == float(np.abs(x[6:]).max())


def test_a_port_in_use_is_one_line_before_anything_runs(tfds_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        message = (
            f"metrics_port {port}: already in use on 0.0.0.0; allowed: a free TCP port "
            "(or no --metrics_port: no Prometheus endpoint)"
        )
        with pytest.raises(UserInputError) as raised:
            PrometheusExporter(port, run_name="x")
        assert str(raised.value) == message
        model_dir = tmp_path / "run"
        with pytest.raises(UserInputError) as raised:
            run_training(tiny_config(tfds_dir), Runtime(str(model_dir), metrics_port=port))
        assert str(raised.value) == message
    assert not model_dir.exists()


@pytest.mark.parametrize("port", [0, 65536, True])
def test_a_port_out_of_range_is_one_line(port):
    with pytest.raises(UserInputError) as raised:
        PrometheusExporter(port, run_name="x")
    assert str(raised.value) == (
        f"metrics_port: received {port!r}. Allowed: an integer >= 1 and <= 65535"
    )


def test_a_run_serves_its_metrics_and_stops_serving_at_its_end(tfds_dir, tmp_path):
    port = _free_port()
    scraper = _Scraper(port, steps=(2, 5))
    run_training(
        tiny_config(tfds_dir),
        Runtime(str(tmp_path / "run"), verbose=0, callbacks=(scraper,), metrics_port=port),
    )
    run = '{run="run"}'
    assert scraper.scrapes[2][f"mpt_train_steps_total{run}"] == 2.0
    assert scraper.scrapes[5][f"mpt_train_steps_total{run}"] == 5.0
    with pytest.raises(OSError):
        _scrape(port)


def test_the_grafana_dashboard_charts_exactly_the_exported_series():
    with open(os.path.join(REPO, "grafana", "mpt_keras.json")) as file:
        dashboard = json.load(file)
    expressions = " ".join(
        target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])
    )
    exported = [*prometheus.GAUGES, prometheus.FLOAT8_GAUGE]
    for name in [*exported, *(f"{name}_total" for name in prometheus.COUNTERS)]:
        assert name in expressions
