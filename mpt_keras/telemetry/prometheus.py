"""`PrometheusExporter` (`mpt-train --metrics_port`): a run's Prometheus metrics.

`http://HOST:PORT/metrics`, chief only, label `run` on every series (`GAUGES`, `COUNTERS`,
`FLOAT8_GAUGE`; meanings: docs/telemetry.md; charts: `grafana/mpt_keras.json`). Per-step
figures come from the step's logs (no sync). A resumed run's counters start at its totals.
"""

from __future__ import annotations

import errno
import socket
import time
from typing import Any

import prometheus_client

from mpt_keras.backend import current
from mpt_keras.checks import check_number
from mpt_keras.errors import UserInputError
from mpt_keras.keras_bridge.callbacks import WorkerHookCallback
from mpt_keras.precision.float8 import float8_statistics, float8_variables
from mpt_keras.scaling.optimizer import LossScaleOptimizer
from mpt_keras.telemetry import layout as tags

GAUGES = {
    "mpt_loss_scale": "The loss scale after the last train step.",
    "mpt_train_loss": "The train loss Keras logs (running mean over the epoch).",
    "mpt_examples_per_second": "Train examples per second over the last interval.",
}
FLOAT8_GAUGE = "mpt_float8_statistic"
FLOAT8_LABELS = ("layer", "tensor", "stat")
COUNTERS = {
    "mpt_train_steps": "Train steps done.",
    "mpt_skipped_steps": "Train steps skipped for non-finite gradients or bad batches.",
    "mpt_bad_batches": "Skipped train steps whose batch or loss held a NaN or Inf.",
    "mpt_nonfinite_events": "(step, variable) pairs whose gradient was non-finite.",
}


def check_port(port: int, address: str = "0.0.0.0") -> None:
    """A one-line `UserInputError` if `port` cannot be served on `address`."""
    check_number("metrics_port", port, minimum=1, maximum=65535, integer=True)
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((address, port))
        except OSError as error:
            why = "already in use" if error.errno == errno.EADDRINUSE else error.strerror
            raise UserInputError(
                f"metrics_port {port}: {why} on {address}; allowed: a free TCP port "
                "(or no --metrics_port: no Prometheus endpoint)"
            ) from None


class PrometheusExporter(WorkerHookCallback):
    """A Keras callback serving the run's metrics to Prometheus (see the module).

    Served from `on_train_begin`, chief only, until `close()`. `port` is checked here
    (`check_port`); `update_every`: steps between reads of the per-variable counts, float8
    statistics and throughput. Its batch hook may run on Keras' worker thread, behind the
    steps; the model is read on `fit`'s thread (`WorkerHookCallback`).

    Example: `model.fit(x, y, callbacks=[PrometheusExporter(9464, run_name="digits")])`.
    """

    def __init__(
        self,
        port: int,
        run_name: str,
        examples_per_step: int | None = None,
        update_every: int = 10,
        address: str = "0.0.0.0",
    ):
        super().__init__()
        check_port(port, address)
        self.port = port
        self.address = address
        self.run_name = run_name
        self.examples_per_step = examples_per_step
        self.update_every = self.read_every = update_every
        self.registry = prometheus_client.CollectorRegistry()
        self._gauges = {
            name: prometheus_client.Gauge(name, text, ["run"], registry=self.registry).labels(
                run=run_name
            )
            for name, text in GAUGES.items()
        }
        self._counters = {
            name: prometheus_client.Counter(name, text, ["run"], registry=self.registry).labels(
                run=run_name
            )
            for name, text in COUNTERS.items()
        }
        self._float8_gauge = prometheus_client.Gauge(
            FLOAT8_GAUGE,
            "A float8 layer's statistic: a tensor's scale, amax or range used, or the "
            "share of its kernel saturated or underflowed at its scale.",
            ["run", *FLOAT8_LABELS],
            registry=self.registry,
        )
        self._float8 = False  # Read float8 statistics: the chief, of a float8 model.
        self._counted = dict.fromkeys(COUNTERS, 0.0)
        self._server: Any = None
        self._interval_start: tuple[int, float] | None = None

    def on_train_begin(self, logs=None):
        super().on_train_begin(logs)
        chief = current.is_chief(self.model)
        self._float8 = chief and bool(float8_variables(self.model))
        if self._server is None and chief:
            self._server, _ = prometheus_client.start_http_server(
                self.port, self.address, registry=self.registry
            )
        self._count("mpt_train_steps", self.global_step)
        self._interval_start = None

    def after_batch(self, previous_step, logs):
        self._count("mpt_train_steps", self.global_step)
        for name, tag in (
            ("mpt_skipped_steps", tags.SKIPPED_STEPS),
            ("mpt_bad_batches", tags.BAD_BATCHES),
        ):
            if tag in logs:
                self._count(name, float(logs[tag]))
        if tags.LOSS_SCALE in logs:
            self._gauges["mpt_loss_scale"].set(float(logs[tags.LOSS_SCALE]))
        if "loss" in logs:
            self._gauges["mpt_train_loss"].set(float(logs["loss"]))
        now = time.perf_counter()
        if self._interval_start is None:
            self._interval_start = (self.global_step, now)  # The first batch compiles.
        elif self.global_step - self._interval_start[0] >= self.update_every:
            start_step, start_time = self._interval_start
            if self.examples_per_step and now > start_time:
                steps = self.global_step - start_step
                rate = self.examples_per_step * steps / (now - start_time)
                self._gauges["mpt_examples_per_second"].set(rate)
            self._interval_start = (self.global_step, now)

    def read_model(self, previous_read_step):
        del previous_read_step  # Counters and gauges: the totals now.
        optimizer = self.model.optimizer
        if isinstance(optimizer, LossScaleOptimizer):
            self._count("mpt_nonfinite_events", sum(optimizer.nonfinite_counts().values()))
        if self._float8:
            for path, statistics in float8_statistics(self.model).items():
                for name, value in statistics.scalars().items():
                    tensor, stat = name.split("/")
                    self._float8_gauge.labels(self.run_name, path, tensor, stat).set(value)

    def close(self) -> None:
        """Stops serving (the endpoint outlives `fit`, for a last scrape)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def _count(self, name: str, total: float) -> None:
        """Advances counter `name` to `total` (counters only go up)."""
        if total > self._counted[name]:
            self._counters[name].inc(total - self._counted[name])
            self._counted[name] = total
