"""`WorkerHookCallback` and the telemetry callbacks built on it, on both backends: each step's
hook runs on Keras' worker thread, behind the steps, with no wait for the device; the model is
read on `fit`'s thread, at that step's state (on JAX a worker's read would race the next step's
donated buffers)."""

from __future__ import annotations

import threading

import keras
import numpy as np

from mpt_keras import LossScaleOptimizer, MetricsCsv, MixedPrecisionMonitor, PrometheusExporter
from mpt_keras.backend import current
from mpt_keras.keras_bridge.callbacks import WorkerHookCallback


class _Reads(WorkerHookCallback):
    """Records where each hook ran and what the model held at each read."""

    def __init__(self, every: int):
        super().__init__()
        self.read_every = every
        self.hook_threads: set[int] = set()
        self.steps: list[int] = []
        self.reads: list[tuple[int, int, int, float]] = []
        self.previous_reads: list[int] = []

    def after_batch(self, previous_step, logs):
        self.hook_threads.add(threading.get_ident())
        self.steps.append(self.global_step)

    def read_model(self, previous_read_step):
        self.previous_reads.append(previous_read_step)
        iterations = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        kernel = float(self.model.layers[0].kernel.numpy()[0, 0])
        self.reads.append((threading.get_ident(), self.global_step, iterations, kernel))


class _Weights(keras.callbacks.Callback):
    """The kernel's first entry after every step (not `async_safe`: hooks run in step)."""

    def __init__(self):
        super().__init__()
        self.kernels: list[float] = []

    def on_train_batch_end(self, batch, logs=None):
        self.kernels.append(float(self.model.layers[0].kernel.numpy()[0, 0]))


def _fit(callbacks: list, epochs: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([np.ones((3, 1), "float32"), np.zeros((1,), "float32")])
    model.compile(optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)), loss="mse")
    x = np.random.RandomState(0).normal(size=(28, 3)).astype("float32")
    y = np.arange(28, dtype="float32")[:, None] / 28
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def test_hooks_run_behind_the_steps_and_reads_see_their_steps_state_on_fits_thread():
    reads, reference = _Reads(every=3), _Weights()
    _fit([reads], epochs=2)  # 7 steps an epoch.
    _fit([reference], epochs=2)

    # Keras' workers may run a later step's hook first: the earlier one is dropped.
    assert reads.steps == sorted(set(reads.steps)) and reads.steps[-1] == 14
    # Keras runs hooks on a worker where its backend is thread safe: JAX, not TensorFlow.
    assert (threading.get_ident() in reads.hook_threads) == (not current.is_jax())
    # At steps 3, 6, 9, 12, at each step's end, then at the end of training (14).
    assert [read[1:3] for read in reads.reads] == [
        (3, 3),
        (6, 6),
        (9, 9),
        (12, 12),
        (14, 14),
    ]
    assert {read[0] for read in reads.reads} == {threading.get_ident()}
    assert reads.previous_reads == [0, 3, 6, 9, 12]
    assert [read[3] for read in reads.reads] == [
        reference.kernels[step - 1] for step in (3, 6, 9, 12, 14)
    ]


def test_reads_follow_their_step_when_another_callback_makes_keras_run_hooks_in_step():
    reads, reference = _Reads(every=2), _Weights()
    _fit([reads, reference])

    assert reads.hook_threads == {threading.get_ident()}
    assert [read[1] for read in reads.reads] == [2, 4, 6, 7]
    assert [read[3] for read in reads.reads] == [reference.kernels[i - 1] for i in (2, 4, 6, 7)]


def test_without_read_at_end_the_last_steps_are_not_read():
    reads = _Reads(every=2)
    reads.read_at_end = False
    _fit([reads])
    assert [read[1] for read in reads.reads] == [2, 4, 6]


def test_the_telemetry_callbacks_let_keras_run_their_hooks_behind_the_steps(tmp_path):
    assert MixedPrecisionMonitor(str(tmp_path)).async_safe
    diagnosing = MixedPrecisionMonitor(str(tmp_path), diagnosis_data=(np.ones((1, 3)),) * 2)
    # A diagnosis runs the model when a step's logs say so: on JAX, in step.
    assert diagnosing.async_safe == (not current.is_jax())
    assert PrometheusExporter.async_safe
    assert MetricsCsv(str(tmp_path / "metrics.csv"), every=2).async_safe
