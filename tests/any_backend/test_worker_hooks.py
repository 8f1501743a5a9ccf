"""`WorkerHookCallback` and the telemetry callbacks built on it, on both backends: each step's
hook runs on Keras' worker thread, behind the steps, with no wait for the device; the model is
read on `fit`'s thread, at that step's state (on JAX a worker's read would race the next step's
donated buffers)."""

from __future__ import annotations

import logging
import threading
import types

import keras
import numpy as np
import pytest

from mpt_keras import (
    BadBatchLimit,
    LossScaleOptimizer,
    MetricsCsv,
    MixedPrecisionMonitor,
    PrometheusExporter,
)
from mpt_keras.backend import current
from mpt_keras.keras_bridge.callbacks import IntervalProgbar, StopAtStep, WorkerHookCallback


class _Reads(WorkerHookCallback):
    """Records where each hook ran and what the model held at each read."""

    def __init__(self, every: int):
        super().__init__()
        self.read_every = every
        self.hook_threads: set[int] = set()
        self.steps: list[int] = []
        self.reads: list[tuple[int, int, int, float]] = []
        self.previous_reads: list[int] = []
        self.work: list[tuple[int, int]] = []  # (thread, optimizer iterations)

    def after_batch(self, previous_step, logs):
        self.hook_threads.add(threading.get_ident())
        self.steps.append(self.global_step)
        if self.global_step == 5:
            self.on_fit_thread(self._work)

    def _work(self):
        iterations = int(keras.ops.convert_to_numpy(self.model.optimizer.iterations))
        self.work.append((threading.get_ident(), iterations))

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


def _fit(callbacks: list, epochs: int = 1, steps_per_execution: int = 1) -> keras.Model:
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((3,)), keras.layers.Dense(1)])
    model.set_weights([np.ones((3, 1), "float32"), np.zeros((1,), "float32")])
    model.compile(
        optimizer=LossScaleOptimizer(keras.optimizers.SGD(0.1)),
        loss="mse",
        steps_per_execution=steps_per_execution,
    )
    x = np.random.RandomState(0).normal(size=(28, 3)).astype("float32")
    y = np.arange(28, dtype="float32")[:, None] / 28
    model.fit(x, y, batch_size=4, epochs=epochs, shuffle=False, verbose=0, callbacks=callbacks)
    return model


def test_hooks_run_behind_the_steps_and_reads_see_their_steps_state_on_fits_thread():
    reads, reference = _Reads(every=3), _Weights()
    _fit([reads], epochs=2)  # 7 steps an epoch.
    _fit([reference], epochs=2)

    # Every step's hook, in step order (Keras' workers may run a later step's hook first).
    assert reads.steps == list(range(1, 15))
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
    # Work handed over at step 5 ran on `fit`'s thread by the read at step 6.
    [(thread, iterations)] = reads.work
    assert thread == threading.get_ident() and iterations in (5, 6)


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


def _begun(callback: WorkerHookCallback) -> WorkerHookCallback:
    """`callback` as `fit` begins it on this thread, at step 0 (no model needed)."""
    iterations = types.SimpleNamespace(numpy=lambda: 0)
    model = types.SimpleNamespace(
        optimizer=types.SimpleNamespace(iterations=iterations), steps_per_execution=1
    )
    callback.set_model(model)
    callback.on_train_begin()
    callback.on_epoch_begin(0)
    return callback


def _on_worker(hook, *args) -> None:
    worker = threading.Thread(target=hook, args=args)
    worker.start()
    worker.join()


def test_hooks_that_come_out_of_order_are_handed_over_in_step_order():
    reads = _begun(_Reads(every=4))
    _on_worker(reads.on_train_batch_end, 1, {"loss": 2.0})
    assert reads.steps == []  # Step 1's hook has not come: step 2's waits.
    _on_worker(reads.on_train_batch_end, 0, {"loss": 1.0})
    assert reads.steps == [1, 2] and reads.global_step == 2


def test_a_read_waits_for_a_missing_hook_then_goes_on_with_a_warning(caplog):
    reads = _begun(_Reads(every=4))
    reads.read_model = lambda previous: reads.reads.append(reads.global_step)
    reads.hook_wait_seconds = 0.05
    for batch in (0, 1, 3):  # Step 3's hook never comes (another callback's raised).
        _on_worker(reads.on_train_batch_end, batch, {})
    with caplog.at_level(logging.WARNING):
        reads.on_train_batch_begin(4)
    assert (reads.steps, reads.reads) == ([1, 2, 4], [4])
    assert caplog.messages == [
        "_Reads: the batch hooks up to step 4 did not come in 0.05 s (did another callback's "
        "batch hook raise?); going on without the missing ones."
    ]
    _on_worker(reads.on_train_batch_end, 2, {})  # Too late: dropped.
    assert reads.steps == [1, 2, 4]


def test_the_telemetry_callbacks_let_keras_run_their_hooks_behind_the_steps(tmp_path):
    assert MixedPrecisionMonitor(str(tmp_path)).async_safe
    # A diagnosis runs the model on `fit`'s thread, at the first batch start after its step.
    assert MixedPrecisionMonitor(str(tmp_path), diagnosis_data=(np.ones((1, 3)),) * 2).async_safe
    assert PrometheusExporter.async_safe
    assert MetricsCsv(str(tmp_path / "metrics.csv"), every=2).async_safe


@pytest.mark.parametrize(
    ("steps_per_execution", "last_step", "steps_run"), [(1, 5, 5), (1, 7, 7), (2, 5, 6)]
)
def test_mpt_trains_callbacks_stop_and_check_behind_the_steps(
    tmp_path, steps_per_execution, last_step, steps_run
):
    # `mpt-train`'s own callbacks (runs.fit_loop), with a probe: Keras runs every batch hook
    # on a worker on JAX, yet the run stops at its step.
    x = np.ones((4, 3), "float32")
    reads = _Reads(every=2)
    callbacks = [
        StopAtStep(last_step),
        IntervalProgbar(last_step),
        BadBatchLimit(0, check_every=2),
        MixedPrecisionMonitor(str(tmp_path), update_freq=2, diagnosis_data=(x, x[:, :1])),
        MetricsCsv(str(tmp_path / "metrics.csv"), every=2),
        reads,
    ]
    model = _fit(callbacks, epochs=2, steps_per_execution=steps_per_execution)
    assert int(keras.ops.convert_to_numpy(model.optimizer.iterations)) == steps_run
    assert reads.steps[-1] == steps_run
    assert (threading.get_ident() in reads.hook_threads) == (not current.is_jax())
